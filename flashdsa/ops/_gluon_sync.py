"""Synchronisation helpers shared by the Gluon kernels (imports Gluon: only the kernel modules import this).

Triton 3.6's shared-memory hazard analysis (what it puts a barrier among a partition's warps for; read from
the LLVM IR's debug locations of our kernels and of small test kernels):

* an ``mbarrier.wait`` counts as a write to its barrier's allocation, so two waits on members of one
  allocation (a ring of barriers indexed at run time) get a barrier between them;
* a one-thread ``mbarrier.arrive`` lowers to a barrier among the warps then one thread's arrive, and the
  analysis then also puts a barrier in front of the next shared-memory access (load, store, wgmma);
* a store before a loop that a wgmma in the loop reads gets its barrier in front of that wgmma, inside the
  loop, so it runs every iteration.

``release`` and ``warps_barrier`` below are the two ways around the last two that our kernels use.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

# a barrier among the calling partition's warps: ``thread_barrier`` in Triton 3.6, ``barrier`` by 3.9
warps_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def release(bar, PTA: gl.constexpr):
    """Tell the other side that this warpgroup is done reading a buffer. PTA (true): every thread arrives by
    itself (``cp.async.mbarrier.arrive.noinc`` with no copies of its own outstanding, so at once), the barrier
    counting 128 arrivals a warpgroup; otherwise one thread arrives after a barrier among the warpgroup's
    warps (what ``mbarrier.arrive`` lowers to), the barrier counting one. Only where every read of the buffer
    by this thread has completed (a wgmma waited for, a loaded value already used): the per-thread arrive
    orders nothing before it. An arrive that publishes writes stays ``mbarrier.arrive``, whose one arrive after
    the barrier orders every thread's stores before it."""
    if PTA:
        async_copy.mbarrier_arrive(bar, increment_count=False)
    else:
        mbarrier.arrive(bar, count=1)
