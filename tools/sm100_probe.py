"""Minimal Blackwell (sm_100a) tcgen05 GEMM probe, compiled GPU-blind and exported with export_to_c.

One CTA of 128 threads (4 warps) computes C = A @ B^T for one 128x128x64 tile:
  A: (M=128, K=64) bf16, K-major      B: (N=128, K=64) bf16, K-major      C: (128, 128) fp32, row-major
  1. warp 0 inits two mbarriers (TMA-load done, MMA done) and issues two TMA loads G->S (A and B)
     with expect_tx on the load barrier;
  2. warp 0 allocates 128 TMEM columns (TmemAllocator), all warps retrieve the TMEM address;
  3. warp 0 waits for the loads and issues the tcgen05.mma's (K=64 = 4 x K16 instructions), then
     tcgen05.commit -> MMA barrier;
  4. all 128 threads wait on the MMA barrier, load the accumulator TMEM->registers with
     tcgen05.ld.32x32b (thread t owns row t, lane t of TMEM) and store fp32 to global memory;
  5. named barrier, then warp 0 deallocates TMEM.

Usage: python tools/sm100_probe.py OUT_DIR [gpu_arch=sm_100a | sm_90a (fails: tcgen05 needs sm_100a) | none]

The first contact with the SM100 toolchain (issue 16): what the forward kernel's building blocks
(TMA into UMMA-layout smem, TmemAllocator, tcgen05.mma via cute.gemm, tcgen05.commit to an
mbarrier, tcgen05.ld of the accumulator) need in this DSL version, GPU-blind. Verified: the PTX
has tcgen05.alloc / mma.cta_group::1.kind::f16 / commit / ld.32x32b + wait::ld, the SASS (nvdisasm
13.5 from the nvidia-cuda-nvdisasm wheel) UTCHMMA, UTCBAR, LDTM.x32, UTMALDG.2D; 134 registers, no
stack. The DSL does not wait for a tcgen05.ld by itself: fence_view_async_tmem_load() does.
"""

import os
import sys
import time

t_import0 = time.perf_counter()
import cuda.bindings.driver as cuda  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
import cutlass.utils.blackwell_helpers as sm100_utils  # noqa: E402
from cutlass.cute.nvgpu import cpasync, tcgen05  # noqa: E402
from cutlass.cute.runtime import make_fake_tensor  # noqa: E402
from cutlass.memory import SmemAllocator, TmemAllocator  # noqa: E402
from cutlass._mlir.dialects import nvvm  # noqa: E402

t_import1 = time.perf_counter()

M, N, K = 128, 128, 64
AB = cutlass.BFloat16
ACC = cutlass.Float32
THREADS = 128
TMEM_COLS = 128  # 128 fp32 columns = the 128x128 accumulator (lane = row)


def tcgen05_fence_before():
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC)


def tcgen05_fence_after():
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC)


class ProbeGemm:
    def __init__(self):
        self.mma_tiler = (M, N, K)
        self.cta_group = tcgen05.CtaGroup.ONE

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, stream: cuda.CUstream):
        tiled_mma = sm100_utils.make_trivial_tiled_mma(
            AB, AB, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, ACC, self.cta_group,
            self.mma_tiler[:2],
        )
        # (MMA, MMA_M, MMA_K, STAGE=1) with the 128B swizzle picked by the helper
        a_smem_layout = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, AB, 1)
        b_smem_layout = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, AB, 1)
        cluster_layout_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))

        a_one = cute.slice_(a_smem_layout, (None, None, None, 0))
        b_one = cute.slice_(b_smem_layout, (None, None, None, 0))
        tma_atom_a, tma_a = cute.nvgpu.make_tiled_tma_atom_A(
            sm100_utils.cluster_shape_to_tma_atom_A((1, 1), tiled_mma.thr_id),
            a, a_one, self.mma_tiler, tiled_mma, cluster_layout_vmnk.shape,
        )
        tma_atom_b, tma_b = cute.nvgpu.make_tiled_tma_atom_B(
            sm100_utils.cluster_shape_to_tma_atom_B((1, 1), tiled_mma.thr_id),
            b, b_one, self.mma_tiler, tiled_mma, cluster_layout_vmnk.shape,
        )
        self.tx_bytes = cute.size_in_bytes(AB, a_one) + cute.size_in_bytes(AB, b_one)

        self.kernel(
            tiled_mma, tma_atom_a, tma_a, tma_atom_b, tma_b, c, cluster_layout_vmnk,
            a_smem_layout, b_smem_layout,
        ).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        mC: cute.Tensor,
        cluster_layout_vmnk: cute.Layout,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()

        @cute.struct
        class SharedStorage:
            load_mbar: cutlass.Int64
            mma_mbar: cutlass.Int64
            tmem_holding_buf: cutlass.Int32

        smem = SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sA = smem.allocate_tensor(element_type=AB, layout=a_smem_layout.outer, byte_alignment=128,
                                  swizzle=a_smem_layout.inner)
        sB = smem.allocate_tensor(element_type=AB, layout=b_smem_layout.outer, byte_alignment=128,
                                  swizzle=b_smem_layout.inner)
        load_mbar = storage.load_mbar.ptr
        mma_mbar = storage.mma_mbar.ptr

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(load_mbar, 1)
                cute.arch.mbarrier_init(mma_mbar, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # ---- partition global / shared for TMA and MMA
        gA = cute.local_tile(mA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None))  # (128,64,1,1)
        gB = cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None))  # (128,64,1,1)
        gC = cute.local_tile(mC, cute.slice_(self.mma_tiler, (None, None, 0)), (None, None))  # (128,128,1,1)
        thr_mma = tiled_mma.get_slice(0)
        tCgA = thr_mma.partition_A(gA)  # (MMA, MMA_M, MMA_K, RestM, RestK)
        tCgB = thr_mma.partition_B(gB)
        tCgC = thr_mma.partition_C(gC)  # (MMA, MMA_M, MMA_N, RestM, RestN)
        tAsA, tAgA = cpasync.tma_partition(
            tma_atom_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 3), cute.group_modes(tCgA, 0, 3))
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3))

        tCrA = tiled_mma.make_fragment_A(sA)  # smem descriptors (MMA, MMA_M, MMA_K, STAGE)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(acc_shape)

        # ---- TMA loads (warp 0; the DSL issues the bulk copy from one thread)
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(load_mbar, self.tx_bytes)
            cute.copy(tma_atom_a, tAgA[(None, 0, 0)], tAsA[(None, 0)], tma_bar_ptr=load_mbar)
            cute.copy(tma_atom_b, tBgB[(None, 0, 0)], tBsB[(None, 0)], tma_bar_ptr=load_mbar)

        # ---- TMEM allocation (warp 0 allocates, everyone reads the address)
        tmem = TmemAllocator(
            storage.tmem_holding_buf.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=1, num_threads=THREADS),
        )
        tmem.allocate(TMEM_COLS)
        tcgen05_fence_before()
        tmem.wait_for_alloc()
        tcgen05_fence_after()
        tmem_ptr = tmem.retrieve_ptr(ACC)
        tCtAcc = cute.make_tensor(tmem_ptr, tCtAcc_fake.layout)  # (MMA, MMA_M, MMA_N) in TMEM

        # ---- MMA: warp 0 waits for the tiles, issues K/16 tcgen05.mma, commits to mma_mbar
        if warp_idx == 0:
            cute.arch.mbarrier_wait(load_mbar, 0)
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for kblk in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                cute.gemm(tiled_mma, tCtAcc, tCrA[(None, None, kblk, 0)], tCrB[(None, None, kblk, 0)], tCtAcc)
                tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
            with cute.arch.elect_one():
                tcgen05.commit(mma_mbar)
        tmem.relinquish_alloc_permit()

        # ---- epilogue: TMEM -> registers (32x32b, 32 columns per instruction) -> global
        cute.arch.mbarrier_wait(mma_mbar, 0)
        tcgen05_fence_after()
        tAcc = tCtAcc[((None, None), 0, 0)]  # (128, 128) fp32 in TMEM
        t2r_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition.x32), ACC)
        tiled_t2r = tcgen05.make_tmem_copy(t2r_atom, tAcc)
        thr_t2r = tiled_t2r.get_slice(tidx)
        tTR_tAcc = thr_t2r.partition_S(tAcc)  # (T2R, T2R_M, T2R_N)
        tTR_gC = thr_t2r.partition_D(tCgC[((None, None), 0, 0, 0, 0)])
        tTR_rAcc = cute.make_rmem_tensor(tTR_gC.shape, ACC)
        cute.copy(tiled_t2r, tTR_tAcc, tTR_rAcc)
        cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld before the registers are read
        cute.copy(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), ACC), tTR_rAcc, tTR_gC)

        # ---- all TMEM reads done (waited above) before warp 0 frees it
        tcgen05_fence_before()
        pipeline.sync(barrier_id=2)
        tcgen05_fence_after()
        tmem.free(tmem_ptr)


def fake_inputs():
    a = make_fake_tensor(AB, (M, K), (K, 1), assumed_align=16)
    b = make_fake_tensor(AB, (N, K), (K, 1), assumed_align=16)
    c = make_fake_tensor(ACC, (M, N), (N, 1), assumed_align=16)
    return a, b, c


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/sm100_probe/out"
    gpu_arch = sys.argv[2] if len(sys.argv) > 2 else "sm_100a"
    os.makedirs(out, exist_ok=True)
    host = "--host-target 'llvm -mtriple=x86_64-unknown-linux-gnu'"
    options = host if gpu_arch == "none" else f"--gpu-arch {gpu_arch} {host}"
    print(f"CUTE_DSL_ARCH={os.environ.get('CUTE_DSL_ARCH')!r} options={options!r}", flush=True)
    a, b, c = fake_inputs()
    t0 = time.perf_counter()
    compiled = cute.compile(ProbeGemm(), a, b, c, cuda.CUstream(0), options=options)
    t1 = time.perf_counter()
    compiled.export_to_c(file_path=out, file_name="probe_sm100", function_prefix="probe_sm100")
    t2 = time.perf_counter()
    print(f"import {t_import1 - t_import0:.1f}s compile {t1 - t0:.1f}s export {t2 - t1:.1f}s")
    for f in sorted(os.listdir(out)):
        print(" ", f, os.path.getsize(os.path.join(out, f)))


if __name__ == "__main__":
    main()
