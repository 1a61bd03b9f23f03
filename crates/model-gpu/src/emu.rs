//! Test-only emulator of the device side: a byte-addressed memory of separate allocations
//! (any access outside one panics, naming the address), the kernels of `llm_kernels.cu`
//! transcribed operation by operation (the same per-thread strides, reduction trees and warp
//! groups), and `cublasGemmEx` by its column-major definition. It executes the exact
//! operation lists `Plan` builds for the GPU, so the tests check against the CPU oracle
//! everything but the CUDA compiler and hardware: argument order and types (also checked
//! against the kernels' C signatures), buffer sizes, offsets into the paged cache, the GEMMs'
//! orientation and leading dimensions, packing, padding and the sampled rows.

use std::collections::BTreeMap;

use bgs_llm::{KvShape, StepModel};
use bgs_model::{ModelConfig, StepItem, Weights};

use crate::host::{self, GpuDtype, StepGeometry};
use crate::model::GpuModelError;
use crate::plan::{self, Arg, Bufs, DevWeights, DeviceMem, Gemm, Kernel, Op, Plan};

/// Device memory: allocations at addresses 256-aligned with gaps between them.
#[derive(Debug)]
pub(crate) struct Emu {
    mem: BTreeMap<u64, Vec<u8>>,
    next: u64,
    dtype: GpuDtype,
}

impl DeviceMem for Emu {
    fn alloc(&mut self, bytes: usize, _what: &str) -> Result<u64, GpuModelError> {
        let p = self.next;
        self.next += (bytes as u64).div_ceil(256) * 256 + 4096;
        self.mem.insert(p, vec![0; bytes.max(4)]);
        Ok(p)
    }

    fn upload(&mut self, bytes: &[u8], what: &str) -> Result<u64, GpuModelError> {
        let p = self.alloc(bytes.len(), what)?;
        self.bytes_mut(p, bytes.len()).copy_from_slice(bytes);
        Ok(p)
    }
}

impl Emu {
    pub(crate) fn new(dtype: GpuDtype) -> Emu {
        Emu {
            mem: BTreeMap::new(),
            next: 0x10_0000,
            dtype,
        }
    }

    fn locate(&self, p: u64, len: usize) -> (u64, usize) {
        let (&base, v) = self
            .mem
            .range(..=p)
            .next_back()
            .unwrap_or_else(|| panic!("access at {p:#x} below every allocation"));
        let off = (p - base) as usize;
        assert!(
            off + len <= v.len(),
            "access of {len} bytes at {p:#x} runs past the allocation at {base:#x} ({} bytes)",
            v.len()
        );
        (base, off)
    }

    fn bytes(&self, p: u64, len: usize) -> &[u8] {
        let (base, off) = self.locate(p, len);
        &self.mem[&base][off..off + len]
    }

    fn bytes_mut(&mut self, p: u64, len: usize) -> &mut [u8] {
        let (base, off) = self.locate(p, len);
        &mut self.mem.get_mut(&base).expect("located")[off..off + len]
    }

    pub(crate) fn f32s(&self, p: u64, n: usize) -> Vec<f32> {
        self.bytes(p, n * 4)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    fn put_f32s(&mut self, p: u64, v: &[f32]) {
        let b = self.bytes_mut(p, v.len() * 4);
        for (c, x) in b.chunks_exact_mut(4).zip(v) {
            c.copy_from_slice(&x.to_le_bytes());
        }
    }

    fn i32s(&self, p: u64, n: usize) -> Vec<i32> {
        self.bytes(p, n * 4)
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    pub(crate) fn put_i32s(&mut self, p: u64, v: &[i32]) {
        let b = self.bytes_mut(p, v.len() * 4);
        for (c, x) in b.chunks_exact_mut(4).zip(v) {
            c.copy_from_slice(&x.to_le_bytes());
        }
    }

    /// `n` elements of the dtype at `p` (element index, not bytes, is `p`'s unit nowhere:
    /// `p` is a byte address), as f32 (`ld`).
    fn wts(&self, p: u64, n: usize) -> Vec<f32> {
        let es = self.dtype.size();
        self.bytes(p, n * es)
            .chunks_exact(es)
            .map(|c| match self.dtype {
                GpuDtype::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                GpuDtype::F16 => half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32(),
                GpuDtype::Bf16 => half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32(),
            })
            .collect()
    }

    /// Store `v` in the dtype at `p` (`st`: round to nearest even).
    fn put_wts(&mut self, p: u64, v: &[f32]) {
        let enc = self.dtype.encode(v);
        self.bytes_mut(p, enc.len()).copy_from_slice(&enc);
    }

    fn run(&mut self, ops: &[Op]) {
        for op in ops {
            match op {
                Op::Launch {
                    kernel,
                    grid,
                    block,
                    shared,
                    args,
                } => self.launch(*kernel, *grid, *block, *shared, args),
                Op::Gemm(g) => self.gemm(g),
            }
        }
    }

    fn gemm(&mut self, g: &Gemm) {
        let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
        let (lda, ldb, ldc) = (g.lda as usize, g.ldb as usize, g.ldc as usize);
        assert!(
            lda >= if g.trans_a { k } else { m },
            "{}: lda {lda}",
            g.what
        );
        assert!(
            ldb >= if g.trans_b { n } else { k },
            "{}: ldb {ldb}",
            g.what
        );
        assert!(ldc >= m, "{}: ldc {ldc}", g.what);
        // Column-major storage extents, read whole (out-of-allocation reads panic).
        let a = self.wts(g.a, lda * if g.trans_a { m } else { k });
        let b = self.wts(g.b, ldb * if g.trans_b { k } else { n });
        let mut c = self.f32s(g.c, ldc * n);
        for j in 0..n {
            for i in 0..m {
                let mut acc = 0f32;
                for l in 0..k {
                    let av = if g.trans_a {
                        a[l + i * lda]
                    } else {
                        a[i + l * lda]
                    };
                    let bv = if g.trans_b {
                        b[j + l * ldb]
                    } else {
                        b[l + j * ldb]
                    };
                    acc += av * bv;
                }
                c[i + j * ldc] = acc;
            }
        }
        self.put_f32s(g.c, &c);
    }

    /// What every fused-form projection requires of its launch: the block the kernels are
    /// written for, every token in the grid, whole 16-byte chunks per row, and (`normed` > 0)
    /// dynamic shared memory for `PROJ_TOKENS` normed rows of `normed` values.
    #[allow(clippy::too_many_arguments)] // one per launch property checked
    fn check_proj(
        &self,
        k: Kernel,
        (gx, gy): (usize, usize),
        block: u32,
        n: usize,
        inp: usize,
        normed: usize,
        shared: u32,
    ) {
        let name = k.name();
        assert_eq!(block as usize, plan::PROJ_WARPS * 32, "{name}: block");
        assert!(gx >= 1, "{name}: empty grid");
        assert!(gy * plan::PROJ_TOKENS >= n, "{name}: grid misses tokens");
        let es = self.dtype.size();
        assert_eq!(
            inp % (16 / es),
            0,
            "{name}: rows of {inp} are not whole 16-byte chunks"
        );
        assert!(
            shared as usize >= plan::PROJ_TOKENS * normed * es,
            "{name}: {shared} bytes of shared memory for {normed}-wide normed rows"
        );
    }

    /// The launch properties the tensor-core GEMM kernels are written for: 16-bit types,
    /// `groups` warp groups a block, every one of `rows` output rows and `n` tokens in the
    /// grid, whole 32-value chunks of the input width `inp`.
    /// The staged small- and mid-tile entry points ([`plan::TC_STAGED_KERNELS`]) take row tiles
    /// x, x + gx, ...: any grid width up to the tiles covers every row, and `shared`, where
    /// given, must hold every block's tiles' weights (or the kernel would load them into
    /// registers: a plan that gives too little has miscounted).
    /// The large-tile entry points ([`plan::TC_LARGE_KERNELS`]) take one group of
    /// `TC_WARPS` warps whatever `groups` (the SiLU form's warps pair its gate and up rows),
    /// a block per [`Kernel::tc_tile_rows`] of the rows (none past them) and exactly
    /// [`plan::tc_large_shared_bytes`] of dynamic shared memory, their pipeline's. The split
    /// ones ([`Kernel::is_tc_large_split`]) take `split` blocks a tile side by side in x (their
    /// last argument, 2..=[`plan::TC_LARGE_SPLIT_MAX`]; 0 for the other kernels), so their
    /// grid's x is the tiles' times that.
    #[allow(clippy::too_many_arguments)] // one launch's properties, each checked
    fn check_tc(
        &self,
        k: Kernel,
        tile: usize,
        (gx, gy): (u32, u32),
        block: u32,
        shared: u32,
        groups: usize,
        split: usize,
        (rows, n, inp): (usize, usize, usize),
    ) {
        let name = k.name();
        assert_ne!(self.dtype, GpuDtype::F32, "{name}: 16-bit types only");
        let gx = if k.is_tc_large_split() {
            assert!(
                (2..=plan::TC_LARGE_SPLIT_MAX).contains(&split),
                "{name}: {split} class groups"
            );
            assert_eq!(
                gx as usize % split,
                0,
                "{name}: {gx} blocks are not whole tiles of {split}"
            );
            gx / split as u32
        } else {
            assert_eq!(split, 0, "{name}: split");
            gx
        };
        let groups = if k.is_tc_large() { 1 } else { groups };
        assert_eq!(
            block as usize,
            groups * plan::TC_WARPS * 32,
            "{name}: block"
        );
        let tiles = rows.div_ceil(plan::TC_ROWS);
        if k.is_tc_large() {
            let units = k.tc_tile_rows().unwrap();
            assert!(
                gx as usize * units >= rows,
                "{name}: grid misses rows ({gx} blocks of {units} for {rows})"
            );
            assert!(
                (gx as usize - 1) * units < rows,
                "{name}: a row block past the rows ({gx} blocks of {units} for {rows})"
            );
            assert_eq!(
                shared as usize,
                plan::tc_large_shared_bytes(),
                "{name}: dynamic shared memory"
            );
        } else if plan::TC_STAGED_KERNELS.contains(&k) {
            assert!(
                gx >= 1 && gx as usize <= tiles,
                "{name}: {gx} blocks for {tiles} row tiles"
            );
            if shared > 0 {
                let mine = tiles.div_ceil(gx as usize);
                let need = mine
                    * groups
                    * plan::TC_WARPS
                    * (inp / plan::TC_CHUNK).div_ceil(plan::TC_WARPS)
                    * 1024;
                assert!(
                    mine <= plan::TC_STAGE_MAX && shared as usize >= need,
                    "{name}: {shared} bytes of shared memory for {mine} staged tiles of {need}"
                );
            }
        } else {
            assert!(
                gx as usize * plan::TC_ROWS >= rows,
                "{name}: grid misses rows"
            );
            assert_eq!(shared, 0, "{name}: dynamic shared memory");
        }
        assert!(gy as usize * tile >= n, "{name}: grid misses tokens");
        assert!(
            (gy as usize - 1) * tile < n,
            "{name}: a token block past the tokens"
        );
        assert_eq!(inp % plan::TC_CHUNK, 0, "{name}: partial chunk");
    }

    /// [`proj_dot`] in the emulated dtype.
    fn proj_dot(&self, w: &[f32], x: &[f32]) -> f32 {
        proj_dot(self.dtype, w, x)
    }

    /// `proj_norm_prologue`: the `n` rows of the residual at `res`, normed (bgs_add_rmsnorm's
    /// arithmetic) and rounded to the dtype, as the shared rows hold them.
    fn normed_rows(&self, res: u64, nw: u64, eps: f32, inp: usize, n: usize) -> Vec<f32> {
        let wv = self.f32s(nw, inp);
        let mut out = Vec::with_capacity(n * inp);
        for t in 0..n {
            let xr = self.f32s(res + (t * inp * 4) as u64, inp);
            let o = rms_norm(&xr, &wv, eps, plan::NORM_THREADS as usize);
            out.extend(o.iter().map(|&v| self.dtype.round(v)));
        }
        out
    }

    /// `gemm_tc_large_body<SILU, true>` (`bgs_gemm_tc_large_split`,
    /// `bgs_gemm_tc_silu_large_split`) over `tiles` (row tiles, token blocks), block by block
    /// through the scratch as the device goes: block z of a tile sums classes 8z / groups ..
    /// 8(z + 1) / groups - 1 of the input's chunks (those with chunks: [`tc_class_sum`], the
    /// wide tile's warp partial sums) for every accumulator element of the tile, padding rows
    /// and tokens included (the last row or token, as the kernel loads them), and stores each
    /// class sum to `part` in the kernel's layout ([`tcl_fragment`]); it counts itself in
    /// `done[tile]` (zero at launch), and the tile's last block reads the eight class sums back
    /// (0 for an empty class), adds them in class order, stores the outputs in range and zeroes
    /// the count. `yo` is y (f32, `out` rows) or, for the SiLU form, act (the dtype, `out`
    /// units: gate rows then up rows in `w`).
    fn gemm_tc_large_split(
        &mut self,
        silu: bool,
        (tx, ty): (usize, usize),
        (w, x, yo): (u64, u64, u64),
        (out, inp, n): (usize, usize, usize),
        (part, done, groups): (u64, u64, usize),
    ) {
        let name = if silu {
            Kernel::GemmTcSiluLargeSplit.name()
        } else {
            Kernel::GemmTcLargeSplit.name()
        };
        assert!(
            self.i32s(done, tx * ty).iter().all(|&c| c == 0),
            "{name}: a tile's count is not zero at launch"
        );
        let classes = plan::TC_WARPS;
        let chunks = inp / plan::TC_CHUNK;
        let per_class = plan::TC_LARGE_SPLIT_PART_BYTES / 4;
        let nt = plan::TC_LARGE_WARP_TOKENS / 8;
        let ws = self.wts(w, if silu { 2 * out } else { out } * inp);
        let xs = self.wts(x, n * inp);
        // The weight row the kernel loads for the block's row i of row tile bx (`grow`).
        let grow = |bx: usize, i: usize| -> usize {
            if silu {
                let u = (bx * (plan::TC_LARGE_ROWS / 2) + (i / 32) * 16 + i % 16).min(out - 1);
                u + if i % 32 >= 16 { out } else { 0 }
            } else {
                (bx * plan::TC_LARGE_ROWS + i).min(out - 1)
            }
        };
        // (the element's index in a class's part, block row i, token of the tile)
        let elements: Vec<(usize, usize, usize)> = (0..plan::TC_WARPS * 32)
            .flat_map(|tid| {
                (0..2).flat_map(move |m| {
                    (0..nt).flat_map(move |j| {
                        (0..4).map(move |k| {
                            let (i, t) = tcl_fragment(tid, m, j, k);
                            (((m * nt + j) * plan::TC_WARPS * 32 + tid) * 4 + k, i, t)
                        })
                    })
                })
            })
            .collect();
        let mut ys = if silu {
            self.wts(yo, n * out)
        } else {
            self.f32s(yo, n * out)
        };
        for by in 0..ty {
            let t0 = by * plan::TC_LARGE_TOKENS;
            for bx in 0..tx {
                let tile = by * tx + bx;
                let at = |cls: usize| part + ((tile * classes + cls) * per_class * 4) as u64;
                let count = done + 4 * tile as u64;
                for z in 0..groups {
                    for cls in
                        (classes * z / groups..classes * (z + 1) / groups).filter(|&c| c < chunks)
                    {
                        let mut sums = vec![0f32; per_class];
                        for &(e, i, t) in &elements {
                            let r = grow(bx, i);
                            let tok = (t0 + t).min(n - 1);
                            sums[e] = tc_class_sum(
                                &ws[r * inp..(r + 1) * inp],
                                &xs[tok * inp..(tok + 1) * inp],
                                cls,
                            );
                        }
                        self.put_f32s(at(cls), &sums);
                    }
                    let c = self.i32s(count, 1)[0] + 1;
                    self.put_i32s(count, &[c]);
                    if c as usize != groups {
                        continue;
                    }
                    assert_eq!(z, groups - 1, "{name}: tile {tile} finished early");
                    // The last block: the class sums in class order.
                    let mut tot = vec![0f32; per_class];
                    for cls in 0..classes {
                        let v = if cls < chunks {
                            self.f32s(at(cls), per_class)
                        } else {
                            vec![0f32; per_class]
                        };
                        for (t, v) in tot.iter_mut().zip(v) {
                            *t = if cls == 0 { v } else { *t + v };
                        }
                    }
                    self.put_i32s(count, &[0]);
                    for &(e, i, t) in &elements {
                        let t = t0 + t;
                        if t >= n {
                            continue;
                        }
                        if silu {
                            // Gate rows (m 0) give the unit; its up row (m 1) sits 16 further.
                            if i % 32 >= 16 {
                                continue;
                            }
                            let u = bx * (plan::TC_LARGE_ROWS / 2) + (i / 32) * 16 + i % 16;
                            let up = e + nt * plan::TC_WARPS * 32 * 4;
                            if u < out {
                                ys[t * out + u] = silu_times(tot[e], tot[up]);
                            }
                        } else {
                            let r = bx * plan::TC_LARGE_ROWS + i;
                            if r < out {
                                ys[t * out + r] = tot[e];
                            }
                        }
                    }
                }
            }
        }
        if silu {
            self.put_wts(yo, &ys);
        } else {
            self.put_f32s(yo, &ys);
        }
    }

    fn launch(&mut self, k: Kernel, grid: (u32, u32), block: u32, shared: u32, args: &[Arg]) {
        let p = |i: usize| match args[i] {
            Arg::P(x) => x,
            a => panic!("{}: argument {i} is {a:?}, not a pointer", k.name()),
        };
        let int = |i: usize| match args[i] {
            Arg::I(x) => x as usize,
            a => panic!("{}: argument {i} is {a:?}, not an int", k.name()),
        };
        let fl = |i: usize| match args[i] {
            Arg::F(x) => x,
            a => panic!("{}: argument {i} is {a:?}, not a float", k.name()),
        };
        let ll = |i: usize| match args[i] {
            Arg::L(x) => x as usize,
            a => panic!("{}: argument {i} is {a:?}, not a long long", k.name()),
        };
        let es = self.dtype.size() as u64;
        let (gx, gy) = (grid.0 as usize, grid.1 as usize);
        // A small-, mid- or large-tile entry point computes its wide form's bits over other
        // token blocks (and, for the large ones, other row blocks).
        let tile = k.tc_tile_tokens().unwrap_or(0);
        let named = k;
        if named.is_tc_large_split() {
            // (w, x, y, out, in, n), or the SiLU form's (w, x, act, inter, in, n, pf,
            // pf_bytes); then (part, done, groups).
            let silu = named.wide() == Kernel::GemmTcSilu;
            let at = if silu { 8 } else { 6 };
            assert_eq!(args.len(), at + 3, "{}: arguments", named.name());
            if silu {
                let _ = (p(6), ll(7));
            }
            let (out, inp, n) = (int(3), int(4), int(5));
            let (part, done, groups) = (p(at), p(at + 1), int(at + 2));
            self.check_tc(named, tile, grid, block, shared, 1, groups, (out, n, inp));
            self.gemm_tc_large_split(
                silu,
                (gx / groups, gy),
                (p(0), p(1), p(2)),
                (out, inp, n),
                (part, done, groups),
            );
            return;
        }
        let k = k.wide();
        match k {
            Kernel::Embed => {
                let (tok, embed, x, h) = (p(0), p(1), p(2), int(3));
                for t in 0..gx {
                    let id = self.i32s(tok + 4 * t as u64, 1)[0] as u32 as u64;
                    let row = self.wts(embed + id * (h as u64) * es, h);
                    self.put_f32s(x + (t * h * 4) as u64, &row);
                }
            }
            Kernel::AddRmsNorm => {
                assert_eq!(block, plan::NORM_THREADS);
                let (x, delta, w, out, h, eps) = (p(0), p(1), p(2), p(3), int(4), fl(5));
                let wv = self.f32s(w, h);
                let nt = block as usize;
                for t in 0..gx {
                    let xa = x + (t * h * 4) as u64;
                    let mut xr = self.f32s(xa, h);
                    if delta != 0 {
                        let d = self.f32s(delta + (t * h * 4) as u64, h);
                        for (v, dv) in xr.iter_mut().zip(&d) {
                            *v += dv;
                        }
                        self.put_f32s(xa, &xr);
                    }
                    let o = rms_norm(&xr, &wv, eps, nt);
                    self.put_wts(out + (t * h) as u64 * es, &o);
                }
            }
            Kernel::RopeKv => {
                let (qkv, bias, pos, slot, inv_freq, cache) = (p(0), p(1), p(2), p(3), p(4), p(5));
                let (nh, nkv, hd, bs, stride) = (int(6), int(7), int(8), int(9), ll(10));
                let half = hd / 2;
                let (qd, kvd) = (nh * hd, nkv * hd);
                let width = qd + 2 * kvd;
                let inv = self.f32s(inv_freq, half);
                let bias = (bias != 0).then(|| self.f32s(bias, width));
                for t in 0..gx {
                    let ra = qkv + (t * width * 4) as u64;
                    let mut row = self.f32s(ra, width);
                    let pp = self.i32s(pos + 4 * t as u64, 1)[0] as f32;
                    let s = self.i32s(slot + 4 * t as u64, 1)[0];
                    let kc = (s >= 0).then(|| {
                        let (blk, off) = (s as usize / bs, s as usize % bs);
                        cache + ((blk * stride + off * hd) as u64) * es
                    });
                    let mut kout = vec![0f32; kvd];
                    for j in 0..(nh + nkv) * half {
                        let (h, i) = (j / half, j % half);
                        let base = h * hd;
                        let (mut x1, mut x2) = (row[base + i], row[base + i + half]);
                        if let Some(b) = &bias {
                            x1 += b[base + i];
                            x2 += b[base + i + half];
                        }
                        let (r1, r2) = rope_rotate(x1, x2, pp, inv[i]);
                        if h < nh {
                            row[base + i] = r1;
                            row[base + i + half] = r2;
                        } else {
                            let kh = h - nh;
                            kout[kh * hd + i] = r1;
                            kout[kh * hd + i + half] = r2;
                        }
                    }
                    self.put_f32s(ra, &row);
                    if let Some(kc) = kc {
                        let vc = kc + ((nkv * bs * hd) as u64) * es;
                        for kh in 0..nkv {
                            let hoff = ((kh * bs * hd) as u64) * es;
                            self.put_wts(kc + hoff, &kout[kh * hd..(kh + 1) * hd]);
                            let v: Vec<f32> = (0..hd)
                                .map(|d| {
                                    let j = qd + kvd + kh * hd + d;
                                    row[j] + bias.as_ref().map_or(0.0, |b| b[j])
                                })
                                .collect();
                            // Bias-free rows add 0.0 here where the kernel adds nothing:
                            // x + 0.0 == x for every x but -0.0, which stores the same value.
                            self.put_wts(vc + hoff, &v);
                        }
                    }
                }
            }
            Kernel::Attention | Kernel::AttentionMma => {
                assert!(
                    block.is_multiple_of(32) && (32..=256).contains(&block),
                    "block {block}"
                );
                let warps = (block / 32) as usize;
                let (qkv, cache, pos, seq, bt_off, bt, out) =
                    (p(0), p(1), p(2), p(3), p(4), p(5), p(6));
                let (nh, nkv, hd, bs, stride, scale) =
                    (int(7), int(8), int(9), int(10), ll(11), fl(12));
                let (qd, kvd) = (nh * hd, nkv * hd);
                let group = nh / nkv;
                // Per-head blocks, or bgs_attention_mma's block per kv head: built for 16-bit
                // values and head sizes 16/32/64 (it traps elsewhere), at most 16 query heads
                // a kv head (an MMA's rows), per warp a K and a V tile of 32 rows in dynamic
                // shared memory. Its splits, softmax and combine are the per-head form's; its
                // products are summed inside MMAs in an order the hardware does not specify,
                // so the emulator computes every head as below (exact math in the per-head
                // order) and the device check bounds the difference.
                if k == Kernel::Attention {
                    assert_eq!((gx, shared), (nh, 0));
                } else {
                    assert_eq!(gx, nkv);
                    assert!(es == 2, "bgs_attention_mma needs 16-bit values");
                    assert!(
                        [16, 32, 64].contains(&hd),
                        "bgs_attention_mma at head_dim {hd}"
                    );
                    assert!((1..=16).contains(&group), "{group} query heads a kv head");
                    assert_eq!(
                        shared as usize,
                        warps * 128 * hd,
                        "bgs_attention_mma's tiles"
                    );
                    assert!(
                        shared as usize <= 48 * 1024,
                        "shared {shared} without an opt-in"
                    );
                }
                for t in 0..gy {
                    let last = self.i32s(pos + 4 * t as u64, 1)[0] as usize;
                    let sq = self.i32s(seq + 4 * t as u64, 1)[0] as u64;
                    let off = self.i32s(bt_off + 4 * sq, 1)[0] as u64;
                    let addr = |tbl: &[i32], p: usize, kvh: usize, v: bool| {
                        let blk = tbl[p / bs] as usize;
                        let e = blk * stride
                            + kvh * bs * hd
                            + if v { nkv * bs * hd } else { 0 }
                            + (p % bs) * hd;
                        cache + e as u64 * es
                    };
                    let table = self.i32s(bt + 4 * off, last / bs + 1);
                    for head in 0..nh {
                        let kvh = head / group;
                        let q = self.f32s(qkv + ((t * (qd + 2 * kvd) + head * hd) * 4) as u64, hd);
                        // Each warp's (max, sum, accumulator) over its groups of 32 positions
                        // (group g to warp g % warps), in the kernel's row-split form when the
                        // head is 2..16 whole 16-byte vectors (the emulator's allocations are
                        // 256-aligned, so the cache always is), else the scalar form.
                        let per16 = 16 / es as usize;
                        let lr = hd / per16;
                        let rows_form = hd % per16 == 0 && [2, 4, 8, 16].contains(&lr);
                        let mut states = Vec::with_capacity(warps);
                        for warp in 0..warps {
                            let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
                            // One accumulator per row of a warp-wide load (RP = 32 / LR rows)
                            // in the row-split form, one in the scalar form.
                            let rp = if rows_form { 32 / lr } else { 1 };
                            let mut accs = vec![vec![0f32; hd]; rp];
                            let mut p0 = warp * 32;
                            while p0 <= last {
                                let mut sc = [f32::NEG_INFINITY; 32];
                                for (lane, s) in sc.iter_mut().enumerate() {
                                    let pp = p0 + lane;
                                    if pp <= last {
                                        let k = self.wts(addr(&table, pp, kvh, false), hd);
                                        let dot = if rows_form {
                                            // LR partial sums of BGS_PER16 dimensions each,
                                            // then the row's butterfly.
                                            let parts: Vec<f32> = (0..lr)
                                                .map(|part| {
                                                    let mut d = 0f32;
                                                    for i in part * per16..(part + 1) * per16 {
                                                        d += q[i] * k[i];
                                                    }
                                                    d
                                                })
                                                .collect();
                                            butterfly(&parts, |a, b| a + b)
                                        } else {
                                            let mut d = 0f32;
                                            for i in 0..hd {
                                                d += q[i] * k[i];
                                            }
                                            d
                                        };
                                        *s = dot * scale;
                                    }
                                }
                                let gmax = butterfly(&sc, f32::max);
                                let mn = m.max(gmax);
                                let mut e = [0f32; 32];
                                for lane in 0..32 {
                                    if p0 + lane <= last {
                                        e[lane] = (sc[lane] - mn).exp();
                                    }
                                }
                                let corr = (m - mn).exp();
                                l = l * corr + butterfly(&e, |a, b| a + b);
                                for a in accs.iter_mut().flatten() {
                                    *a *= corr;
                                }
                                // Position p0 + j goes to row j % RP's accumulator, each row's
                                // positions in order.
                                for (j, &w) in e.iter().enumerate().take((last - p0 + 1).min(32)) {
                                    let v = self.wts(addr(&table, p0 + j, kvh, true), hd);
                                    for (a, x) in accs[j % rp].iter_mut().zip(&v) {
                                        *a += w * x;
                                    }
                                }
                                m = mn;
                                p0 += 32 * warps;
                            }
                            // The rows' accumulators meet in the butterfly (dimension by
                            // dimension; one row: unchanged).
                            let acc: Vec<f32> = (0..hd)
                                .map(|d| {
                                    let col: Vec<f32> = accs.iter().map(|a| a[d]).collect();
                                    butterfly(&col, |a, b| a + b)
                                })
                                .collect();
                            states.push((m, l, acc));
                        }
                        let o: Vec<f32> = if warps == 1 {
                            let (_, l, acc) = &states[0];
                            acc.iter().map(|a| a / l).collect()
                        } else {
                            // The kernel's combine, in warp order.
                            let mm = states.iter().fold(f32::NEG_INFINITY, |a, s| a.max(s.0));
                            let (mut ll, mut oo) = (0f32, vec![0f32; hd]);
                            for (m, l, acc) in &states {
                                let f = if *m == f32::NEG_INFINITY {
                                    0.0
                                } else {
                                    (m - mm).exp()
                                };
                                ll += l * f;
                                for d in 0..hd {
                                    oo[d] += acc[d] * f;
                                }
                            }
                            oo.iter().map(|a| a / ll).collect()
                        };
                        self.put_wts(out + ((t * qd + head * hd) as u64) * es, &o);
                    }
                }
            }
            Kernel::SiluMul => {
                let (gu, out, inter, tokens) = (p(0), p(1), int(2), int(3));
                assert_eq!(gy, tokens, "bgs_silu_mul: a row of blocks per token");
                assert!(
                    gx * block as usize >= inter,
                    "bgs_silu_mul: the grid covers a row"
                );
                for t in 0..tokens {
                    let row = self.f32s(gu + (t * 2 * inter * 4) as u64, 2 * inter);
                    let o: Vec<f32> = (0..inter)
                        .map(|i| silu_times(row[i], row[inter + i]))
                        .collect();
                    self.put_wts(out + (t * inter) as u64 * es, &o);
                }
            }
            Kernel::GatherRows => {
                let (xn, rows, out, h) = (p(0), p(1), p(2), int(3));
                for s in 0..gx {
                    let r = self.i32s(rows + 4 * s as u64, 1)[0] as u64;
                    let row = self.bytes(xn + r * h as u64 * es, h * es as usize).to_vec();
                    self.bytes_mut(out + (s * h) as u64 * es, row.len())
                        .copy_from_slice(&row);
                }
            }
            Kernel::Proj | Kernel::ProjAdd => {
                let (w, x, y, out, inp, n) = (p(0), p(1), p(2), int(3), int(4), int(5));
                self.check_proj(k, (gx, gy), block, n, inp, 0, shared);
                let xs = self.wts(x, n * inp);
                let mut ys = self.f32s(y, n * out);
                for r in 0..out {
                    let wr = self.wts(w + (r * inp) as u64 * es, inp);
                    for t in 0..n {
                        let d = self.proj_dot(&wr, &xs[t * inp..(t + 1) * inp]);
                        let o = &mut ys[t * out + r];
                        *o = if k == Kernel::ProjAdd { *o + d } else { d };
                    }
                }
                self.put_f32s(y, &ys);
            }
            Kernel::GemmTc | Kernel::GemmTcAddNorm => {
                // (w, x, y, out, in, n), and for the folded o and down steps (nw, eps, xn,
                // done): y += the product, then xn = y's rows normed.
                let (w, x, y, out, inp, n) = (p(0), p(1), p(2), int(3), int(4), int(5));
                let norm = k == Kernel::GemmTcAddNorm;
                self.check_tc(named, tile, grid, block, shared, 1, 0, (out, n, inp));
                let xs = self.wts(x, n * inp);
                let mut ys = self.f32s(y, n * out);
                for r in 0..out {
                    let wr = self.wts(w + (r * inp) as u64 * es, inp);
                    for t in 0..n {
                        let d = tc_dot(&wr, &xs[t * inp..(t + 1) * inp]);
                        let o = &mut ys[t * out + r];
                        *o = if norm { *o + d } else { d };
                    }
                }
                self.put_f32s(y, &ys);
                if norm {
                    let (nw, eps, xn, done) = (p(6), fl(7), p(8), p(9));
                    assert!(
                        self.i32s(done, gy).iter().all(|&c| c == 0),
                        "{}: a token block's count is not zero at launch",
                        named.name()
                    );
                    let normed = self.normed_rows(y, nw, eps, out, n);
                    self.put_wts(xn, &normed);
                }
            }
            Kernel::GemmTcSilu => {
                // (w, x, act, inter, in, n)
                let w = p(0);
                let (act, inter, inp, n) = (p(2), int(3), int(4), int(5));
                self.check_tc(named, tile, grid, block, shared, 2, 0, (inter, n, inp));
                let xs = self.wts(p(1), n * inp);
                let mut o = vec![0f32; n * inter];
                for i in 0..inter {
                    let wg = self.wts(w + (i * inp) as u64 * es, inp);
                    let wu = self.wts(w + ((inter + i) * inp) as u64 * es, inp);
                    for t in 0..n {
                        let xt = &xs[t * inp..(t + 1) * inp];
                        o[t * inter + i] = silu_times(tc_dot(&wg, xt), tc_dot(&wu, xt));
                    }
                }
                self.put_wts(act, &o);
            }
            Kernel::ProjNormSilu => {
                let (w, res, nw, eps, act) = (p(0), p(1), p(2), fl(3), p(4));
                let (inter, inp, n) = (int(5), int(6), int(7));
                self.check_proj(k, (gx, gy), block, n, inp, inp, shared);
                let xs = self.normed_rows(res, nw, eps, inp, n);
                let mut o = vec![0f32; n * inter];
                for i in 0..inter {
                    let wg = self.wts(w + (i * inp) as u64 * es, inp);
                    let wu = self.wts(w + ((inter + i) * inp) as u64 * es, inp);
                    for t in 0..n {
                        let xr = &xs[t * inp..(t + 1) * inp];
                        o[t * inter + i] =
                            silu_times(self.proj_dot(&wg, xr), self.proj_dot(&wu, xr));
                    }
                }
                self.put_wts(act, &o);
            }
            Kernel::ProjNormRopeKv | Kernel::GemmTcRopeKv => {
                // (w, res, nw, eps, qkv, ...) normed in the prologue (the fused form), or
                // (w, xn, qkv, ...) over normed rows (the folded form); then bgs_rope_kv's
                // parameters, in, n.
                let tc = k == Kernel::GemmTcRopeKv;
                let at = if tc { 3 } else { 5 };
                let (w, qkv, bias) = (p(0), p(at - 1), p(at));
                let (pos, slot, inv_freq, cache) = (p(at + 1), p(at + 2), p(at + 3), p(at + 4));
                let (nh, nkv, hd) = (int(at + 5), int(at + 6), int(at + 7));
                let (bs, stride) = (int(at + 8), ll(at + 9));
                let (inp, n) = (int(at + 10), int(at + 11));
                if tc {
                    let rows = (nh + 2 * nkv) * hd;
                    assert_eq!(hd % plan::TC_ROWS, 0, "{}: head_dim", k.name());
                    assert_eq!(
                        gx * plan::TC_ROWS,
                        rows,
                        "{}: a block per 16 rows",
                        k.name()
                    );
                    self.check_tc(named, tile, grid, block, shared, 1, 0, (rows, n, inp));
                } else {
                    self.check_proj(k, (gx, gy), block, n, inp, inp, shared);
                }
                let dt = self.dtype;
                let dot = |w: &[f32], x: &[f32]| {
                    if tc { tc_dot(w, x) } else { proj_dot(dt, w, x) }
                };
                let xs = if tc {
                    self.wts(p(1), n * inp)
                } else {
                    self.normed_rows(p(1), p(2), fl(3), inp, n)
                };
                let half = hd / 2;
                let (qd, kvd) = (nh * hd, nkv * hd);
                let width = qd + 2 * kvd;
                let inv = self.f32s(inv_freq, half);
                let bias = (bias != 0).then(|| self.f32s(bias, width));
                let rows: Vec<Vec<f32>> = (0..width)
                    .map(|r| self.wts(w + (r * inp) as u64 * es, inp))
                    .collect();
                for t in 0..n {
                    let xr = &xs[t * inp..(t + 1) * inp];
                    let pp = self.i32s(pos + 4 * t as u64, 1)[0] as f32;
                    let s = self.i32s(slot + 4 * t as u64, 1)[0];
                    let kc = (s >= 0).then(|| {
                        let (blk, off) = (s as usize / bs, s as usize % bs);
                        cache + ((blk * stride + off * hd) as u64) * es
                    });
                    let qa = qkv + (t * width * 4) as u64;
                    let mut q = self.f32s(qa, qd);
                    for u in 0..(nh + 2 * nkv) * half {
                        let (h, i) = (u / half, u % half);
                        let base = h * hd;
                        let mut x1 = dot(&rows[base + i], xr);
                        let mut x2 = dot(&rows[base + i + half], xr);
                        if let Some(b) = &bias {
                            x1 += b[base + i];
                            x2 += b[base + i + half];
                        }
                        let (v1, v2) = if h < nh + nkv {
                            rope_rotate(x1, x2, pp, inv[i])
                        } else {
                            (x1, x2)
                        };
                        if h < nh {
                            q[base + i] = v1;
                            q[base + i + half] = v2;
                        } else if let Some(kc) = kc {
                            // k heads then v heads: the k and v halves of the cache block.
                            let at = kc + (((h - nh) * bs * hd) as u64) * es;
                            self.put_wts(at + (i as u64) * es, &[v1]);
                            self.put_wts(at + ((i + half) as u64) * es, &[v2]);
                        }
                    }
                    self.put_f32s(qa, &q);
                }
            }
            Kernel::Argmax => {
                assert_eq!(block, plan::ARGMAX_THREADS);
                let (logits, next, vocab) = (p(0), p(1), int(2));
                for s in 0..gx {
                    let row = self.f32s(logits + (s * vocab * 4) as u64, vocab);
                    let (_, i) = block_argmax(&row, 0, vocab, block as usize);
                    let id = if i == u32::MAX { 0 } else { i };
                    self.put_i32s(next + 4 * s as u64, &[id as i32]);
                }
            }
            Kernel::ArgmaxSplit => {
                // (logits, next, vocab, cand, done): slice y of ceil(vocab / gy) ids per block,
                // the parts' winners combined in order by the row's last block.
                assert_eq!(block, plan::ARGMAX_SPLIT_THREADS);
                let (logits, next, vocab, done) = (p(0), p(1), int(2), p(4));
                assert!(gy >= 1);
                assert!(
                    self.i32s(done, gx).iter().all(|&c| c == 0),
                    "bgs_argmax_split: a row's count is not zero at launch"
                );
                let span = vocab.div_ceil(gy);
                for s in 0..gx {
                    let row = self.f32s(logits + (s * vocab * 4) as u64, vocab);
                    let (mut v, mut id) = (f32::NEG_INFINITY, u32::MAX);
                    for y in 0..gy {
                        let (lo, hi) = ((y * span).min(vocab), ((y + 1) * span).min(vocab));
                        let (pv, pi) = block_argmax(&row, lo, hi, block as usize);
                        better(&mut v, &mut id, pv, pi);
                    }
                    let id = if id == u32::MAX { 0 } else { id };
                    self.put_i32s(next + 4 * s as u64, &[id as i32]);
                }
            }
            Kernel::GemmTcSmall
            | Kernel::GemmTcSiluSmall
            | Kernel::GemmTcAddNormSmall
            | Kernel::GemmTcRopeKvSmall
            | Kernel::GemmTcMid
            | Kernel::GemmTcSiluMid
            | Kernel::GemmTcAddNormMid
            | Kernel::GemmTcRopeKvMid
            | Kernel::GemmTcLarge
            | Kernel::GemmTcSiluLarge
            | Kernel::GemmTcLargeSplit
            | Kernel::GemmTcSiluLargeSplit => unreachable!("k is the wide form (Kernel::wide)"),
        }
    }
}

/// `better` in the kernels: (v, i) replaces the best when larger, or equal with a lower id
/// (NaN never compares larger, so never wins).
fn better(bv: &mut f32, bi: &mut u32, v: f32, i: u32) {
    if v > *bv || (v == *bv && i < *bi) {
        *bv = v;
        *bi = i;
    }
}

/// One argmax block over `row[lo..hi]` with `nt` threads (`bgs_argmax`, `bgs_argmax_split`):
/// thread t's strided scan from lo + t (strictly larger values only), then the shared-memory
/// tree with `better`. (-inf, u32::MAX) where nothing is above -inf.
fn block_argmax(row: &[f32], lo: usize, hi: usize, nt: usize) -> (f32, u32) {
    let mut sv = vec![f32::NEG_INFINITY; nt];
    let mut si = vec![u32::MAX; nt];
    for tid in 0..nt {
        for i in (lo + tid..hi).step_by(nt) {
            if row[i] > sv[tid] {
                sv[tid] = row[i];
                si[tid] = i as u32;
            }
        }
    }
    let mut h = nt / 2;
    while h > 0 {
        for tid in 0..h {
            let (mut v, mut i) = (sv[tid], si[tid]);
            better(&mut v, &mut i, sv[tid + h], si[tid + h]);
            sv[tid] = v;
            si[tid] = i;
        }
        h >>= 1;
    }
    (sv[0], si[0])
}

/// `proj_dot`: lane l sums the 16-byte chunks l, l + 32, ... of `w · x` (each chunk's values in
/// order), then the butterfly.
fn proj_dot(dtype: GpuDtype, w: &[f32], x: &[f32]) -> f32 {
    let per16 = 16 / dtype.size();
    let chunks = w.len() / per16;
    let mut lanes = [0f32; 32];
    for (l, acc) in lanes.iter_mut().enumerate() {
        for c in (l..chunks).step_by(32) {
            for k in c * per16..(c + 1) * per16 {
                *acc += w[k] * x[k];
            }
        }
    }
    butterfly(&lanes, |a, b| a + b)
}

/// The kernels' `rope_rotate`: the rotate-half pair (x1, x2) at position `p`, frequency `f`.
fn rope_rotate(x1: f32, x2: f32, p: f32, f: f32) -> (f32, f32) {
    let a = p * f;
    let (c, sn) = (a.cos(), a.sin());
    (x1 * c + (-x2) * sn, x2 * c + x1 * sn)
}

/// The kernels' `silu_times` before the store: silu(g) · u.
fn silu_times(g: f32, u: f32) -> f32 {
    g / (1.0 + (-g).exp()) * u
}

/// `bgs_add_rmsnorm`'s arithmetic over one row: `nt` threads' strided sums of squares in index
/// order, the shared-memory tree, then `w · (x · inv)`.
fn rms_norm(xr: &[f32], wv: &[f32], eps: f32, nt: usize) -> Vec<f32> {
    let h = xr.len();
    let mut sh: Vec<f32> = (0..nt)
        .map(|tid| {
            let mut acc = 0f32;
            for i in (tid..h).step_by(nt) {
                acc += xr[i] * xr[i];
            }
            acc
        })
        .collect();
    let mut s = nt / 2;
    while s > 0 {
        for tid in 0..s {
            sh[tid] += sh[tid + s];
        }
        s >>= 1;
    }
    let inv = 1.0 / (sh[0] / h as f32 + eps).sqrt();
    (0..h).map(|i| wv[i] * (xr[i] * inv)).collect()
}

/// The xor butterfly of the kernels' `warp_sum` / `warp_max` over `v.len()` lanes (a power of
/// two; offsets len/2 .. 1), as lane 0 sees it.
fn butterfly(v: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    assert!(
        v.len().is_power_of_two(),
        "butterfly over {} lanes",
        v.len()
    );
    let mut v = v.to_vec();
    let mut o = v.len() / 2;
    while o > 0 {
        let prev = v.clone();
        for (l, x) in v.iter_mut().enumerate() {
            *x = f(prev[l], prev[l ^ o]);
        }
        o >>= 1;
    }
    v[0]
}

/// `bgs_gemm_tc`'s order: warp w sums the 32-value chunks w, w + TC_WARPS, ... in order (each
/// chunk's products in order; the MMA's own order inside a chunk is the hardware's:
/// [`tc_class_sum`]), then the warps' sums are added in warp order.
fn tc_dot(w: &[f32], x: &[f32]) -> f32 {
    let mut total = 0f32;
    for warp in 0..plan::TC_WARPS {
        let acc = tc_class_sum(w, x, warp);
        total = if warp == 0 { acc } else { total + acc };
    }
    total
}

/// A wide tile's warp `cls` partial sum (0 without chunks): the 32-value chunks cls, cls +
/// TC_WARPS, ... in order, each chunk's products in order. The large tiles' class `cls` sum.
fn tc_class_sum(w: &[f32], x: &[f32], cls: usize) -> f32 {
    let chunks = w.len() / plan::TC_CHUNK;
    let mut acc = 0f32;
    for c in (cls..chunks).step_by(plan::TC_WARPS) {
        for k in c * plan::TC_CHUNK..(c + 1) * plan::TC_CHUNK {
            acc += w[k] * x[k];
        }
    }
    acc
}

/// Where element k of thread `tid`'s accumulator fragment (m, j) of a large tile lies:
/// (the block's weight row, the token within the tile), as `gemm_tc_large_body` stores it
/// (warp `tid / 32` at warp row wr, column wc; lane group g, quad q: row wr * 32 + m * 16 + g
/// (+ 8 for k 2, 3), token wc * TC_LARGE_WARP_TOKENS + 8j + 2q (+ 1 for odd k)). The SiLU form
/// reads row i as gate unit (i / 32) * 16 + i % 16 for i % 32 < 16 (m 0) and that unit's up row
/// for m 1.
fn tcl_fragment(tid: usize, m: usize, j: usize, k: usize) -> (usize, usize) {
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, q) = (lane / 4, lane % 4);
    let wcols = plan::TC_WARPS / plan::TC_LARGE_WARP_ROWS;
    let (wr, wc) = (warp / wcols, warp % wcols);
    let h = if k >= 2 { 8 } else { 0 };
    (
        wr * 32 + m * 16 + g + h,
        wc * plan::TC_LARGE_WARP_TOKENS + j * 8 + 2 * q + (k & 1),
    )
}

/// `plan::alloc_bufs`'s `split_tiles` as `GpuModel::new` passes it (the device's
/// multiprocessors where the large tiles split, else 0; the emulated device holds the large
/// tiles' shared memory).
fn split_tiles(tc_large_split: usize, sms: u32) -> usize {
    if tc_large_split >= 2 { sms as usize } else { 0 }
}

/// The GPU model's host side over the emulator (the same plan, packing and buffers).
#[derive(Debug)]
pub(crate) struct EmuModel {
    cfg: ModelConfig,
    geo: StepGeometry,
    dtype: GpuDtype,
    emu: Emu,
    w: DevWeights,
    b: Bufs,
    cache: u64,
    inputs: u64,
    staging: Vec<i32>,
    invariant_gemm: bool,
    fused_max_tokens: usize,
    tc_gemm_max_tokens: usize,
    attention_warps: u32,
    tensor_core_attention: bool,
    tc_epilogues: bool,
    tc_fold_max_tokens: usize,
    tc_small_max_tokens: usize,
    tc_mid_max_tokens: usize,
    tc_large_min_tokens: usize,
    tc_large_split: usize,
    sms: u32,
    tc_stage_bytes: usize,
    split_argmax: bool,
}

impl EmuModel {
    pub(crate) fn new(
        cfg: ModelConfig,
        weights: &Weights,
        dtype: GpuDtype,
        [block_size, num_blocks, max_batched_tokens, max_seqs]: [usize; 4],
        invariant_gemm: bool,
    ) -> EmuModel {
        host::check_config(&cfg).unwrap();
        let mut emu = Emu::new(dtype);
        let w = plan::upload_weights(&mut emu, weights, dtype).unwrap();
        let geo =
            host::geometry(&cfg, block_size, num_blocks, max_batched_tokens, max_seqs).unwrap();
        // Few multiprocessors: the norm kernels' grids are capped below their units, so the
        // plan's grid-stride sizing is exercised.
        let sms = 2;
        let tc_large_split = crate::GpuModelOptions::default().tensor_core_large_split;
        let b = plan::alloc_bufs(
            &mut emu,
            &cfg,
            geo.max_tokens,
            geo.max_samples,
            dtype,
            split_tiles(tc_large_split, sms),
        )
        .unwrap();
        let cache = emu
            .alloc(
                num_blocks * host::kv_block_bytes(&cfg, block_size, dtype),
                "kv",
            )
            .unwrap();
        let inputs = emu.alloc(geo.words() * 4, "inputs").unwrap();
        // As `GpuModel::new`: the invariant option on the tensor-core GEMM where it covers the
        // model, else in the fused form.
        let invariant_tc = invariant_gemm && plan::tc_gemm_covers(&cfg, dtype);
        EmuModel {
            staging: vec![0; geo.words()],
            cfg,
            geo,
            dtype,
            emu,
            w,
            b,
            cache,
            inputs,
            invariant_gemm: invariant_gemm && !invariant_tc,
            fused_max_tokens: 0,
            // As `GpuModelOptions`' default.
            tc_gemm_max_tokens: if invariant_tc {
                usize::MAX
            } else {
                crate::GpuModelOptions::default().tensor_core_gemm_max_tokens
            },
            attention_warps: 1,
            // As `GpuModelOptions`' default: every test plans tensor-core attention where the
            // model allows it.
            tensor_core_attention: true,
            tc_epilogues: crate::GpuModelOptions::default().tensor_core_gemm_epilogues,
            tc_fold_max_tokens: crate::GpuModelOptions::default().tensor_core_gemm_fold_max_tokens,
            tc_small_max_tokens: crate::GpuModelOptions::default()
                .tensor_core_small_tiles_max_tokens,
            tc_mid_max_tokens: crate::GpuModelOptions::default().tensor_core_mid_tiles_max_tokens,
            tc_large_min_tokens: crate::GpuModelOptions::default()
                .tensor_core_large_tiles_min_tokens,
            tc_large_split,
            sms,
            // An H100/H200's opt-in limit (227 KB): the plan stages where its rules say.
            tc_stage_bytes: plan::tc_stage_budget(232_448),
            split_argmax: true,
        }
    }

    /// Small tensor-core tiles for buckets of at most `n` tokens (as
    /// `GpuModelOptions::tensor_core_small_tiles_max_tokens`).
    pub(crate) fn with_tc_small_max_tokens(mut self, n: usize) -> EmuModel {
        self.tc_small_max_tokens = n;
        self
    }

    /// Mid tensor-core tiles for buckets of more than `plan::TC_SMALL_TOKENS` and at most `n`
    /// tokens (as `GpuModelOptions::tensor_core_mid_tiles_max_tokens`).
    pub(crate) fn with_tc_mid_max_tokens(mut self, n: usize) -> EmuModel {
        self.tc_mid_max_tokens = n;
        self
    }

    /// Large tensor-core tiles for buckets of at least `n` tokens (as
    /// `GpuModelOptions::tensor_core_large_tiles_min_tokens`; 0: none).
    pub(crate) fn with_tc_large_min_tokens(mut self, n: usize) -> EmuModel {
        self.tc_large_min_tokens = n;
        self
    }

    /// Large tiles split over `groups` blocks a tile where their grid has fewer blocks than
    /// multiprocessors (as `GpuModelOptions::tensor_core_large_split`; 0 or 1: never). The
    /// buffers are allocated again with the split form's scratch sized as `GpuModel::new`
    /// sizes it (a tile a multiprocessor where split is on, else none).
    pub(crate) fn with_tc_large_split(mut self, groups: usize) -> EmuModel {
        self.tc_large_split = groups;
        self.realloc_bufs();
        self
    }

    /// `n` multiprocessors for the plan (2 unless set), the split form's scratch sized for
    /// them (the buffers are allocated again).
    pub(crate) fn with_sms(mut self, n: u32) -> EmuModel {
        self.sms = n;
        self.realloc_bufs();
        self
    }

    /// Fresh activation buffers (`plan::alloc_bufs`, as `GpuModel::new` calls it) for the
    /// current split setting and multiprocessors: only while building, before any step.
    fn realloc_bufs(&mut self) {
        self.b = plan::alloc_bufs(
            &mut self.emu,
            &self.cfg,
            self.geo.max_tokens,
            self.geo.max_samples,
            self.dtype,
            split_tiles(self.tc_large_split, self.sms),
        )
        .unwrap();
    }

    /// The LM head's argmax over `plan::ARGMAX_PARTS` blocks a row (true, as the launched
    /// form) or one (false, as the persistent form).
    pub(crate) fn with_split_argmax(mut self, on: bool) -> EmuModel {
        self.split_argmax = on;
        self
    }

    /// Dynamic shared memory a staged small- or mid-tile block may take (0: never staged; as
    /// `GpuModelOptions::tensor_core_staged_tiles` on a device allowing `n + 16 KB`).
    pub(crate) fn with_tc_stage_bytes(mut self, n: usize) -> EmuModel {
        self.tc_stage_bytes = n;
        self
    }

    /// The folded form up to `n` tokens (as
    /// `GpuModelOptions::tensor_core_gemm_fold_max_tokens`).
    pub(crate) fn with_tc_fold_max_tokens(mut self, n: usize) -> EmuModel {
        self.tc_fold_max_tokens = n;
        self
    }

    /// SiLU·up folded into the tensor-core gate/up GEMM (as
    /// `GpuModelOptions::tensor_core_gemm_epilogues`).
    pub(crate) fn with_tc_epilogues(mut self, on: bool) -> EmuModel {
        self.tc_epilogues = on;
        self
    }

    /// Split attention across `w` warps (as `GpuModelOptions::attention_warps`).
    pub(crate) fn with_attention_warps(mut self, w: u32) -> EmuModel {
        self.attention_warps = w;
        self
    }

    /// Attention on tensor cores (as `GpuModelOptions::tensor_core_attention`).
    pub(crate) fn with_tensor_core_attention(mut self, on: bool) -> EmuModel {
        self.tensor_core_attention = on;
        self
    }

    /// Projections over at most `n` tokens on `bgs_gemm_tc` (as
    /// `GpuModelOptions::tensor_core_gemm_max_tokens`).
    pub(crate) fn with_tc_gemm_max_tokens(mut self, n: usize) -> EmuModel {
        self.tc_gemm_max_tokens = n;
        self
    }

    /// Buckets of at most `n` tokens in the fused form (as `GpuModelOptions::fused_max_tokens`).
    pub(crate) fn with_fused_max_tokens(mut self, n: usize) -> EmuModel {
        plan::fused_form_fits(&self.cfg, self.dtype).unwrap();
        self.fused_max_tokens = n;
        self
    }

    fn plan(&self) -> Plan<'_> {
        Plan {
            cfg: &self.cfg,
            geo: &self.geo,
            dtype: self.dtype,
            w: &self.w,
            b: &self.b,
            cache: self.cache,
            inputs: self.inputs,
            invariant_gemm: self.invariant_gemm,
            fused_max_tokens: self.fused_max_tokens,
            tc_gemm_max_tokens: self.tc_gemm_max_tokens,
            sms: self.sms,
            attention_warps: self.attention_warps,
            mma_attention: self.tensor_core_attention
                && plan::mma_attention_shared(&self.cfg, self.dtype, self.attention_warps)
                    .is_some(),
            tc_epilogues: self.tc_epilogues,
            tc_fold_max_tokens: self.tc_fold_max_tokens,
            tc_small_max_tokens: self.tc_small_max_tokens,
            tc_mid_max_tokens: self.tc_mid_max_tokens,
            tc_large_min_tokens: self.tc_large_min_tokens,
            tc_large_split: self.tc_large_split,
            // Every projection of the tiny models has few chunks: let them split.
            tc_large_split_min_chunks: 1,
            staging: plan::TcStaging {
                bytes: self.tc_stage_bytes,
                ..plan::TcStaging::from(&crate::GpuModelOptions::default())
            },
            split_argmax: self.split_argmax,
        }
    }

    /// Run a step; the sampled rows' item indices.
    fn forward(&mut self, items: &[StepItem<'_>], want: &[bool]) -> Result<host::Packed, String> {
        let p = host::pack_step(
            &self.geo,
            items,
            want,
            self.cfg.vocab_size,
            self.cfg.max_position_embeddings,
            &mut self.staging,
        )?;
        // Only the packed prefix is copied, as on the GPU: stale words past it must not matter.
        self.emu.put_i32s(self.inputs, &self.staging[..p.words]);
        let mut ops = self.plan().body(p.bucket);
        if p.sample_bucket > 0 {
            ops.extend(self.plan().head(p.sample_bucket));
        }
        self.emu.run(&ops);
        Ok(p)
    }

    pub(crate) fn step_logits(&mut self, items: &[StepItem<'_>]) -> Vec<Vec<f32>> {
        let p = self.forward(items, &vec![true; items.len()]).unwrap();
        let v = self.cfg.vocab_size;
        let all = self.emu.f32s(self.b.logits, p.samples * v);
        all.chunks_exact(v).map(<[f32]>::to_vec).collect()
    }
}

impl StepModel for EmuModel {
    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }
    fn eos_ids(&self) -> &[u32] {
        &self.cfg.eos_token_ids
    }
    fn max_positions(&self) -> usize {
        self.cfg.max_position_embeddings
    }
    fn kv(&self) -> KvShape {
        KvShape {
            block_size: self.geo.block_size,
            num_blocks: self.geo.num_blocks,
        }
    }
    fn step(&mut self, items: &[StepItem<'_>], next: &mut [u32]) -> Result<(), String> {
        let want: Vec<bool> = items.iter().map(|it| it.sample).collect();
        let p = self.forward(items, &want)?;
        let got = self.emu.i32s(self.b.next, p.samples);
        for (&i, &t) in p.sampled_items.iter().zip(&got) {
            next[i] = t as u32;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bgs_model::synth::{DType, SplitMix64, SynthArch, synth_config, synth_weights_for};
    use bgs_model::{CpuModel, KvConfig};

    /// Greedy generation with chunked prefill (the binary's driver, simplified): sequence `i`
    /// uses blocks `i * per ..`.
    fn generate(
        m: &mut dyn StepModel,
        prompts: &[Vec<u32>],
        steps: usize,
        chunk: usize,
        per: usize,
    ) -> Vec<Vec<u32>> {
        let tables: Vec<Vec<u32>> = (0..prompts.len())
            .map(|i| ((i * per) as u32..((i + 1) * per) as u32).collect())
            .collect();
        let mut fed = vec![0usize; prompts.len()];
        let mut out = vec![Vec::new(); prompts.len()];
        loop {
            let mut work = Vec::new();
            for (i, p) in prompts.iter().enumerate() {
                if out[i].len() >= steps {
                    continue;
                }
                if fed[i] < p.len() {
                    let end = (fed[i] + chunk).min(p.len());
                    work.push((i, p[fed[i]..end].to_vec(), fed[i], end == p.len()));
                } else {
                    let last: u32 = *out[i].last().unwrap();
                    work.push((i, vec![last], p.len() + out[i].len() - 1, true));
                }
            }
            if work.is_empty() {
                return out;
            }
            let items: Vec<StepItem<'_>> = work
                .iter()
                .map(|(i, t, pos, s)| StepItem {
                    tokens: t,
                    pos: *pos,
                    blocks: &tables[*i],
                    sample: *s,
                })
                .collect();
            let mut next = vec![0u32; items.len()];
            m.step(&items, &mut next).unwrap();
            for ((i, t, _, s), &n) in work.iter().zip(&next) {
                if fed[*i] < prompts[*i].len() {
                    fed[*i] += t.len();
                }
                if *s {
                    out[*i].push(n);
                }
            }
        }
    }

    /// A step of sequence i's `toks[i]` at position `pos[i]` over block table `blocks[i]`,
    /// every sequence sampled.
    fn sampled<'a>(
        toks: &'a [Vec<u32>],
        blocks: &'a [Vec<u32>],
        pos: &[usize],
    ) -> Vec<StepItem<'a>> {
        toks.iter()
            .zip(blocks)
            .zip(pos)
            .map(|((t, b), &pos)| StepItem {
                tokens: t,
                pos,
                blocks: b,
                sample: true,
            })
            .collect()
    }

    /// The logits of a prefill step of prompts of `lens` tokens (sequence i on blocks
    /// i·per .. (i + 1)·per), then of a decode step of one token each after them.
    fn prefill_then_decode_logits(
        m: &mut EmuModel,
        lens: &[usize],
        per: u32,
    ) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let vocab = m.cfg.vocab_size;
        let b = lens.len() as u32;
        let prompts = prompts(vocab, lens);
        let blocks: Vec<Vec<u32>> = (0..b).map(|i| (i * per..(i + 1) * per).collect()).collect();
        let next: Vec<Vec<u32>> = (0..b).map(|i| vec![(7 * i + 1) % vocab as u32]).collect();
        let first = m.step_logits(&sampled(&prompts, &blocks, &vec![0; lens.len()]));
        (first, m.step_logits(&sampled(&next, &blocks, lens)))
    }

    fn prompts(vocab: usize, lens: &[usize]) -> Vec<Vec<u32>> {
        let mut rng = SplitMix64::new(99);
        lens.iter()
            .map(|&n| {
                (0..n)
                    .map(|_| (rng.next_u64() % vocab as u64) as u32)
                    .collect()
            })
            .collect()
    }

    fn max_rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| {
                let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                x.iter()
                    .zip(y)
                    .map(|(p, q)| (p - q).abs() / scale)
                    .fold(0f32, f32::max)
            })
            .fold(0f32, f32::max)
    }

    fn check_arch(arch: SynthArch, dtype: GpuDtype, tol: f32, exact_tokens: bool, inv: bool) {
        let cfg = synth_config(arch);
        check_arch_with(cfg, dtype, tol, exact_tokens, inv, 1, &[3, 9, 1, 14]);
    }

    fn check_arch_with(
        cfg: ModelConfig,
        dtype: GpuDtype,
        tol: f32,
        exact_tokens: bool,
        inv: bool,
        warps: u32,
        lens: &[usize],
    ) {
        check_model(cfg, dtype, tol, exact_tokens, inv, warps, lens, 0);
    }

    /// `check_arch_with` with buckets of at most `fused` tokens in the fused form; each
    /// sequence alone must equal the batch only when every bucket takes one form.
    #[allow(clippy::too_many_arguments)] // the axes the tests vary
    fn check_model(
        cfg: ModelConfig,
        dtype: GpuDtype,
        tol: f32,
        exact_tokens: bool,
        inv: bool,
        warps: u32,
        lens: &[usize],
        fused: usize,
    ) {
        let dt = match dtype {
            GpuDtype::F32 => DType::F32,
            GpuDtype::F16 => DType::F16,
            GpuDtype::Bf16 => DType::Bf16,
        };
        let arch = format!("{:?} head_dim {}", cfg.arch, cfg.head_dim);
        let (cfg, w) = synth_weights_for(cfg, 5, dt);
        let bs = 4;
        let per = (lens.iter().max().unwrap() + 21).div_ceil(bs);
        // Token capacity 32 and 4 items: buckets and padding are exercised.
        // (Long prompts need a token capacity that holds the whole prefill of the logit check.)
        let capacity = 30.max(lens.iter().sum::<usize>());
        let mut emu = EmuModel::new(cfg.clone(), &w, dtype, [bs, 4 * per, capacity, 4], inv)
            .with_attention_warps(warps);
        if fused > 0 {
            emu = emu.with_fused_max_tokens(fused);
        }
        let one_form = inv || fused == 0 || fused >= emu.geo.max_tokens;
        let mut cpu = CpuModel::new(
            cfg.clone(),
            w,
            KvConfig {
                block_size: bs,
                num_blocks: 4 * per,
            },
            1,
        )
        .unwrap();
        let ps = prompts(cfg.vocab_size, lens);
        let tables: Vec<Vec<u32>> = (0..4)
            .map(|i| ((i * per) as u32..((i + 1) * per) as u32).collect())
            .collect();
        let items = sampled(&ps, &tables, &[0; 4]);
        let d = max_rel_diff(&cpu.step_logits(&items).unwrap(), &emu.step_logits(&items));
        assert!(
            d <= tol,
            "{arch} {dtype:?}: prefill logits differ by {d} (tolerance {tol})"
        );
        // Chunks of 5 over prompts of 3..14 tokens: mixed prefill/decode steps, 3..17 tokens.
        let want = generate(&mut cpu, &ps, 20, 5, per);
        let got = generate(&mut emu, &ps, 20, 5, per);
        if exact_tokens {
            assert_eq!(want, got, "{arch} {dtype:?}: greedy tokens differ");
        }
        // Batch invariance through the same plan: each sequence alone.
        for (i, p) in ps.iter().enumerate().filter(|_| one_form) {
            let alone = generate(&mut emu, std::slice::from_ref(p), 20, 5, per);
            assert_eq!(
                alone[0], got[i],
                "{arch} {dtype:?}: sequence {i} alone differs"
            );
        }
    }

    #[test]
    fn emulated_plan_matches_the_cpu_oracle_in_f32() {
        check_arch(SynthArch::TinyQwen2, GpuDtype::F32, 1e-4, true, false);
        check_arch(SynthArch::TinyLlama, GpuDtype::F32, 1e-4, true, false);
    }

    /// Attention split across 2 and 4 warps (prompts long enough that every warp holds
    /// positions): f32 tokens still equal the oracle's, each sequence alone equals the batch.
    #[test]
    fn emulated_attention_across_warps_matches_the_cpu_oracle() {
        for warps in [2, 4] {
            check_arch_with(
                synth_config(SynthArch::TinyQwen2),
                GpuDtype::F32,
                1e-4,
                true,
                false,
                warps,
                &[3, 100, 1, 130],
            );
        }
    }

    /// Attention's forms by head size: 64 (the real models': the row-split form with 8 lanes
    /// a row in bf16, 16 in f32), 24 (the scalar form: not whole 16-byte vectors in bf16, 6
    /// lanes in f32) and 8 in bf16 (one vector a row: the scalar form), with 1 and 4 warps and
    /// positions past 128: tokens in f32 equal the oracle's, each sequence alone equals the
    /// batch.
    #[test]
    fn emulated_attention_forms_by_head_size_match_the_cpu_oracle() {
        for (head_dim, dtype, tol, exact) in [
            (64, GpuDtype::F32, 1e-4, true),
            (64, GpuDtype::Bf16, 3e-2, false),
            (24, GpuDtype::F32, 1e-4, true),
            (24, GpuDtype::Bf16, 3e-2, false),
            (8, GpuDtype::Bf16, 3e-2, false),
        ] {
            let mut cfg = synth_config(SynthArch::TinyQwen2);
            cfg.head_dim = head_dim;
            for warps in [1, 4] {
                check_arch_with(
                    cfg.clone(),
                    dtype,
                    tol,
                    exact,
                    false,
                    warps,
                    &[3, 100, 1, 140],
                );
            }
        }
    }

    /// The invariant option in both its forms: the fused form (f32: tokens equal the oracle's)
    /// and the tensor-core GEMM for every bucket (bf16: within the tolerance), each sequence
    /// alone equal to the batch.
    #[test]
    fn emulated_invariant_gemm_matches_the_cpu_oracle() {
        let forms = |arch, dtype, inv| {
            let dt = match dtype {
                GpuDtype::F32 => DType::F32,
                GpuDtype::F16 => DType::F16,
                GpuDtype::Bf16 => DType::Bf16,
            };
            let (cfg, w) = synth_weights_for(synth_config(arch), 5, dt);
            let m = EmuModel::new(cfg, &w, dtype, [4, 64, 32, 4], inv);
            let ops = m.plan().body(32);
            let tc = ops.iter().any(|op| {
                matches!(
                    op,
                    Op::Launch {
                        kernel: Kernel::GemmTc,
                        ..
                    }
                )
            });
            let blas = ops.iter().any(|op| matches!(op, Op::Gemm(_)));
            (tc, blas, m.plan().fused(32))
        };
        assert_eq!(
            forms(SynthArch::TinyQwen2, GpuDtype::F32, true),
            (false, false, true)
        );
        assert_eq!(
            forms(SynthArch::TinyLlama, GpuDtype::Bf16, true),
            (true, false, false)
        );
        assert_eq!(
            forms(SynthArch::TinyLlama, GpuDtype::Bf16, false),
            (false, true, false)
        );
        check_arch(SynthArch::TinyQwen2, GpuDtype::F32, 1e-4, true, true);
        check_arch(SynthArch::TinyLlama, GpuDtype::Bf16, 5e-2, false, true);
    }

    /// The fused form (own projections with the norms, RoPE/KV, SiLU and residual adds fused
    /// in): for every bucket, f32 tokens equal the oracle's and each sequence alone equals the
    /// batch; bf16 within the tolerance; and mixed with cuBLAS (buckets of at most 4 tokens
    /// fused, decode steps of 1..4 sequences) f32 tokens still equal the oracle's.
    #[test]
    fn emulated_fused_form_matches_the_cpu_oracle() {
        let lens = [3, 9, 1, 14];
        for arch in [SynthArch::TinyQwen2, SynthArch::TinyLlama] {
            let cfg = synth_config(arch);
            check_model(
                cfg.clone(),
                GpuDtype::F32,
                1e-4,
                true,
                false,
                1,
                &lens,
                1 << 20,
            );
            check_model(
                cfg.clone(),
                GpuDtype::Bf16,
                5e-2,
                false,
                false,
                4,
                &lens,
                1 << 20,
            );
            check_model(cfg, GpuDtype::F32, 1e-4, true, false, 1, &lens, 4);
        }
        // Head size 64 (the real models': two 16-byte chunks a lane in the QKV rows of q).
        let mut cfg = synth_config(SynthArch::TinyQwen2);
        cfg.head_dim = 64;
        check_model(
            cfg,
            GpuDtype::F32,
            1e-4,
            true,
            false,
            4,
            &[3, 40, 1, 70],
            1 << 20,
        );
    }

    /// The fused form's plan: 5 launches a layer (no cuBLAS), the final norm for the LM head,
    /// against 9 operations a layer for larger buckets; the shapes it cannot run are refused
    /// with the reason.
    #[test]
    fn fused_form_plan_and_limits() {
        let (cfg, w) = synth_weights_for(synth_config(SynthArch::TinyQwen2), 5, DType::F32);
        let m = EmuModel::new(cfg.clone(), &w, GpuDtype::F32, [4, 64, 32, 4], false)
            .with_fused_max_tokens(8);
        let layers = cfg.num_layers;
        let fused = m.plan().body(8);
        assert_eq!(fused.len(), 1 + 5 * layers + 1);
        assert!(fused.iter().all(|op| matches!(op, Op::Launch { .. })));
        let last = fused.last().unwrap();
        assert!(matches!(
            last,
            Op::Launch {
                kernel: Kernel::AddRmsNorm,
                ..
            }
        ));
        assert_eq!(m.plan().body(16).len(), 1 + 1 + 9 * layers);
        let mut odd = cfg.clone();
        odd.hidden_size = 60;
        let e = plan::fused_form_fits(&odd, GpuDtype::Bf16).unwrap_err();
        assert!(e.contains("hidden_size 60"), "{e}");
        let mut wide = cfg;
        wide.hidden_size = 2048;
        let e = plan::fused_form_fits(&wide, GpuDtype::F32).unwrap_err();
        assert!(e.contains("shared memory"), "{e}");
        assert!(plan::fused_form_fits(&wide, GpuDtype::Bf16).is_ok());
        for arch in [SynthArch::Qwen25_05b, SynthArch::Smollm2_135m] {
            for dt in [GpuDtype::F32, GpuDtype::Bf16] {
                assert!(plan::fused_form_fits(&synth_config(arch), dt).is_ok());
            }
        }
    }

    /// Tensor-core attention is planned where it applies (16-bit values, head sizes 16/32/64,
    /// at most 16 query heads a kv head, tiles within 48 KB), a block per kv head with its
    /// tiles' shared memory; elsewhere (f32, other head sizes, 8 warps of 64-wide heads) the
    /// per-head blocks. Its logits through the emulator are held to the bf16 tolerance of the
    /// CPU oracle by the other tests (it is the emulator's default; head size 64 with 4 warps
    /// and positions past 128: `emulated_attention_forms_by_head_size_match_the_cpu_oracle`).
    #[test]
    fn tensor_core_attention_is_planned_where_it_applies() {
        let attention = |m: &EmuModel| -> Vec<(Kernel, (u32, u32), u32)> {
            m.plan()
                .body(8)
                .into_iter()
                .filter_map(|op| match op {
                    Op::Launch {
                        kernel: k @ (Kernel::Attention | Kernel::AttentionMma),
                        grid,
                        shared,
                        ..
                    } => Some((k, grid, shared)),
                    _ => None,
                })
                .collect()
        };
        for (dtype, dt, head_dim, warps, mma) in [
            (GpuDtype::Bf16, DType::Bf16, 64, 4, true),
            (GpuDtype::F16, DType::F16, 16, 1, true),
            (GpuDtype::Bf16, DType::Bf16, 64, 8, false),
            (GpuDtype::Bf16, DType::Bf16, 24, 4, false),
            (GpuDtype::F32, DType::F32, 64, 4, false),
        ] {
            let mut cfg = synth_config(SynthArch::TinyQwen2);
            cfg.head_dim = head_dim;
            let (cfg, w) = synth_weights_for(cfg, 5, dt);
            let m = EmuModel::new(cfg.clone(), &w, dtype, [4, 64, 32, 4], false)
                .with_attention_warps(warps);
            let ops = attention(&m);
            assert_eq!(ops.len(), cfg.num_layers);
            for (k, grid, shared) in ops {
                if mma {
                    assert_eq!(k, Kernel::AttentionMma);
                    assert_eq!(grid, (cfg.num_kv_heads as u32, 8));
                    assert_eq!(shared as usize, warps as usize * 128 * head_dim);
                } else {
                    let per_head = (Kernel::Attention, (cfg.num_heads as u32, 8), 0);
                    assert_eq!((k, grid, shared), per_head);
                }
            }
            let off = EmuModel::new(cfg, &w, dtype, [4, 64, 32, 4], false)
                .with_attention_warps(warps)
                .with_tensor_core_attention(false);
            assert!(
                attention(&off)
                    .iter()
                    .all(|&(k, _, _)| k == Kernel::Attention)
            );
        }
        // 17 query heads a kv head: more than an MMA's 16 rows.
        let mut wide = synth_config(SynthArch::TinyQwen2);
        (wide.num_heads, wide.num_kv_heads, wide.head_dim) = (17, 1, 16);
        assert_eq!(plan::mma_attention_shared(&wide, GpuDtype::Bf16, 4), None);
        let qwen = synth_config(SynthArch::Qwen25_05b);
        assert_eq!(
            plan::mma_attention_shared(&qwen, GpuDtype::Bf16, 4),
            Some(4 * 128 * 64)
        );
    }

    /// The tensor-core GEMM is planned for 16-bit projections over at most
    /// `tensor_core_gemm_max_tokens` tokens (the LM head by its sampled rows) whose input width
    /// is whole 32-value chunks, with a grid covering every row and token; cuBLAS elsewhere
    /// (larger buckets, f32, other widths). Its logits through the emulator are held to the
    /// bf16 tolerance of the CPU oracle by `emulated_invariant_gemm_matches_the_cpu_oracle`
    /// (the invariant option runs it for every bucket).
    #[test]
    fn tensor_core_gemm_is_planned_where_it_applies() {
        let ops = |m: &EmuModel, body: usize, head: usize| -> (usize, usize) {
            let all = [m.plan().body(body), m.plan().head(head)].concat();
            // (The gate/up GEMM carries SiLU·up as its epilogue.)
            let tc = all
                .iter()
                .filter(|op| {
                    matches!(op, Op::Launch { kernel, .. } if kernel.tc_tile_tokens().is_some())
                })
                .count();
            let blas = all.iter().filter(|op| matches!(op, Op::Gemm(_))).count();
            (tc, blas)
        };
        let (cfg, w) = synth_weights_for(synth_config(SynthArch::TinyQwen2), 5, DType::Bf16);
        let gemms = 4 * cfg.num_layers + 1;
        let m = EmuModel::new(cfg.clone(), &w, GpuDtype::Bf16, [4, 64, 32, 4], false)
            .with_tc_gemm_max_tokens(8);
        assert_eq!(ops(&m, 8, 4), (gemms, 0));
        assert_eq!(ops(&m, 16, 4), (1, gemms - 1));
        let vocab = cfg.vocab_size;
        let head = m.plan().head(4);
        let Some(Op::Launch {
            grid, block, args, ..
        }) = head.iter().find(|op| {
            matches!(
                op,
                Op::Launch {
                    kernel: Kernel::GemmTcSmall,
                    ..
                }
            )
        })
        else {
            panic!("no small-tile tensor-core LM head");
        };
        assert_eq!(*grid, (vocab.div_ceil(16) as u32, 1));
        assert_eq!(*block as usize, plan::TC_WARPS * 32);
        assert_eq!(args[3..], [Arg::I(vocab as i32), Arg::I(64), Arg::I(4)]);
        let off = EmuModel::new(cfg.clone(), &w, GpuDtype::Bf16, [4, 64, 32, 4], false)
            .with_tc_gemm_max_tokens(0);
        assert_eq!(ops(&off, 8, 4), (0, gemms));
        let (cfg32, w32) = synth_weights_for(synth_config(SynthArch::TinyQwen2), 5, DType::F32);
        let f32m = EmuModel::new(cfg32, &w32, GpuDtype::F32, [4, 64, 32, 4], false);
        assert_eq!(ops(&f32m, 8, 4), (0, gemms));
        assert!(plan::tc_gemm_applies(GpuDtype::F16, 4864));
        assert!(!plan::tc_gemm_applies(GpuDtype::Bf16, 48));
        assert!(!plan::tc_gemm_applies(GpuDtype::F32, 896));
        // The served shapes' every width is whole chunks.
        for arch in [SynthArch::Qwen25_05b, SynthArch::Smollm2_135m] {
            let c = synth_config(arch);
            for inp in [c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim] {
                assert!(plan::tc_gemm_applies(GpuDtype::Bf16, inp), "{arch:?} {inp}");
            }
        }
        // A token's outputs do not depend on the rest of its bucket: tokens 0..3 of a 40-token
        // GEMM (two token blocks) equal the same rows computed in a 4-token one.
        let mut e = Emu::new(GpuDtype::Bf16);
        let (out, inp) = (40usize, 96usize);
        let wv: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 7919) % 61) as f32 / 61.0 - 0.5)
            .collect();
        let xv: Vec<f32> = (0..40 * inp)
            .map(|i| ((i * 104_729) % 53) as f32 / 53.0 - 0.5)
            .collect();
        let wd = e.upload(&GpuDtype::Bf16.encode(&wv), "w").unwrap();
        let xd = e.upload(&GpuDtype::Bf16.encode(&xv), "x").unwrap();
        let y40 = e.alloc(40 * out * 4, "y40").unwrap();
        let y4 = e.alloc(4 * out * 4, "y4").unwrap();
        let gemm = |y: u64, n: usize| {
            let args = [wd, xd, y].map(Arg::P);
            let dims = [out, inp, n].map(|v| Arg::I(v as i32));
            plan::tc_gemm_launch(Kernel::GemmTc, out, n, &[args, dims].concat())
        };
        e.run(&[gemm(y40, 40), gemm(y4, 4)]);
        assert_eq!(e.f32s(y40, 4 * out), e.f32s(y4, 4 * out));
        assert!(e.f32s(y4, 4 * out).iter().any(|&v| v != 0.0));
    }

    #[test]
    fn emulated_plan_stays_within_the_bf16_and_f16_tolerance() {
        check_arch(SynthArch::TinyQwen2, GpuDtype::Bf16, 5e-2, false, false);
        check_arch(SynthArch::TinyLlama, GpuDtype::F16, 5e-2, false, false);
    }

    /// The parameter types of `name`'s C signature in the kernel source (the `extern "C"
    /// __global__` declaration, launch bounds or not): 'P' pointer, 'I' int, 'F' float, 'L'
    /// long long.
    /// The tensor-core entry points come from a macro (`BGS_TC_ENTRY_POINTS(SUF, TOK, STAGE)`,
    /// its lines continued with backslashes) instantiated for every tile width: `bgs_gemm_tc`,
    /// `bgs_gemm_tc_small` and `bgs_gemm_tc_mid` are all `bgs_gemm_tc##SUF` there. The
    /// large-tile ones (`bgs_gemm_tc_large`, `bgs_gemm_tc_silu_large` and their `_split`
    /// forms) are declared by their own names (or, should the macro ever be instantiated for
    /// `_large`, come from it too).
    fn signature(name: &str) -> Vec<char> {
        let src = crate::KERNEL_SOURCE.replace("\\\n", "\n");
        let mut base = name;
        for suf in ["_small", "_mid", "_large"] {
            if let Some(b) = name.strip_suffix(suf) {
                let from_macro = src.contains(&format!("BGS_TC_ENTRY_POINTS({suf},"));
                assert!(
                    from_macro || suf == "_large",
                    "{name}: no {suf} entry points"
                );
                if from_macro {
                    base = b;
                }
            }
        }
        let calls = [format!("{name}("), format!("{base}##SUF(")];
        let start = src
            .match_indices("extern \"C\" __global__")
            .filter_map(|(at, _)| {
                let decl = &src[at..at + src[at..].find('{')?];
                calls.iter().find_map(|call| {
                    let i = decl.find(call.as_str())?;
                    // The name itself, not a longer one ending in it.
                    decl[..i].ends_with(char::is_whitespace).then_some(at + i)
                })
            })
            .next()
            .unwrap_or_else(|| panic!("{name} not in the kernel source"));
        let open = start + src[start..].find('(').unwrap();
        let close = open + src[open..].find(')').unwrap();
        src[open + 1..close]
            .split(',')
            .map(|p| {
                let p = p.trim();
                if p.contains('*') {
                    'P'
                } else if p.starts_with("long long") {
                    'L'
                } else if p.starts_with("float") {
                    'F'
                } else if p.starts_with("int") {
                    'I'
                } else {
                    panic!("{name}: unexpected parameter {p:?}")
                }
            })
            .collect()
    }

    #[test]
    fn every_launch_matches_its_kernel_signature() {
        let mut seen = Vec::new();
        for (arch, dtype, inv, mma) in [
            (SynthArch::TinyQwen2, GpuDtype::Bf16, false, true),
            (SynthArch::TinyQwen2, GpuDtype::Bf16, false, false),
            (SynthArch::TinyLlama, GpuDtype::F32, true, true),
            // The invariant option on tensor cores (bgs_gemm_tc).
            (SynthArch::TinyLlama, GpuDtype::Bf16, true, true),
        ] {
            let (cfg, w) = synth_weights_for(synth_config(arch), 1, DType::F32);
            let m = EmuModel::new(cfg.clone(), &w, dtype, [16, 8, 64, 8], inv)
                .with_tensor_core_attention(mma)
                .with_tc_fold_max_tokens(64)
                .with_tc_mid_max_tokens(plan::TC_MID_TOKENS);
            // With the epilogues apart; and SiLU·up alone folded (the default).
            // (and the one-block argmax, as the persistent form runs it)
            let apart = EmuModel::new(cfg.clone(), &w, dtype, [16, 8, 64, 8], inv)
                .with_tc_epilogues(false)
                .with_split_argmax(false)
                .with_tc_mid_max_tokens(plan::TC_MID_TOKENS);
            // The split large tiles where the split grid has a block a multiprocessor, at 64
            // tokens: on 4 multiprocessors QKV (2 tiles of 2 blocks, a block a chunk) and
            // down_proj (a tile of 4) split, gate/up's 4 tiles run unsplit; on 8 gate/up
            // splits (4 tiles of 2 blocks), QKV's 4 blocks and down_proj's 4 fall short.
            let split = EmuModel::new(cfg.clone(), &w, dtype, [16, 8, 64, 8], inv)
                .with_sms(4)
                .with_tc_large_split(8);
            let silu_split = EmuModel::new(cfg.clone(), &w, dtype, [16, 8, 64, 8], inv)
                .with_sms(8)
                .with_tc_large_split(8);
            let narrow = ModelConfig {
                head_dim: 8,
                num_heads: 2 * cfg.num_heads,
                num_kv_heads: 2 * cfg.num_kv_heads,
                ..cfg
            };
            let (narrow, wn) = synth_weights_for(narrow, 1, DType::F32);
            let silu = EmuModel::new(narrow, &wn, dtype, [16, 8, 64, 8], inv)
                .with_tc_fold_max_tokens(64)
                .with_tc_mid_max_tokens(plan::TC_MID_TOKENS);
            // (32 tokens: the wide tensor-core tiles; 8: the small ones; 16: the mid ones; 64:
            // the large ones, by default.)
            let plans = [m, apart, silu, split, silu_split].map(|m| {
                let p = m.plan();
                [
                    p.body(64),
                    p.body(32),
                    p.body(8),
                    p.head(8),
                    p.body(16),
                    p.head(16),
                ]
            });
            for ops in plans.into_iter().flatten() {
                for op in ops {
                    if let Op::Launch { kernel, args, .. } = op {
                        let kinds: Vec<char> = args
                            .iter()
                            .map(|a| match a {
                                Arg::P(_) => 'P',
                                Arg::I(_) => 'I',
                                Arg::F(_) => 'F',
                                Arg::L(_) => 'L',
                            })
                            .collect();
                        assert_eq!(kinds, signature(kernel.name()), "{}", kernel.name());
                        seen.push(kernel);
                    }
                }
            }
        }
        for k in Kernel::ALL {
            assert!(seen.contains(&k), "{} never launched", k.name());
        }
    }

    /// The folded form's o_proj, gate/up and down_proj launches each name the weights of the
    /// op after next for `prefetch_lines_l2` (their last two arguments): o_proj gate/up's,
    /// gate/up down's, down_proj the next layer's QKV (nothing after the last layer), each
    /// whole; but nothing where that op's launch stages its weights in shared memory itself.
    /// With staging off every target is prefetched; on the emulator's two multiprocessors
    /// gate/up stages (more row tiles than multiprocessors) and is not.
    #[test]
    fn folded_launches_prefetch_the_weights_of_the_op_after_next() {
        let (cfg, w) = synth_weights_for(synth_config(SynthArch::TinyQwen2), 3, DType::Bf16);
        let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim;
        for stage_bytes in [0, plan::tc_stage_budget(232_448)] {
            let m = EmuModel::new(cfg.clone(), &w, GpuDtype::Bf16, [16, 16, 64, 16], true)
                .with_tc_fold_max_tokens(64)
                .with_tc_stage_bytes(stage_bytes);
            let ops = m.plan().body(4);
            // Each weight matrix's launch: whether it stages (shared memory for its weights).
            let staged = |weights: u64| {
                ops.iter().any(|op| {
                    matches!(op, Op::Launch { args, shared, .. }
                        if args.first() == Some(&Arg::P(weights)) && *shared > 0)
                })
            };
            let mut seen = Vec::new();
            for op in &ops {
                let Op::Launch { kernel, args, .. } = op else {
                    continue;
                };
                if !matches!(kernel, Kernel::GemmTcAddNormSmall | Kernel::GemmTcSiluSmall) {
                    continue;
                }
                let (Arg::P(weights), [.., Arg::P(pf), Arg::L(bytes)]) = (args[0], &args[..])
                else {
                    panic!("{kernel:?}: {args:?}");
                };
                seen.push((*kernel, weights, *pf, *bytes));
            }
            assert_eq!(seen.len(), 3 * cfg.num_layers);
            let layers = &m.w.layers;
            let want = |target: u64, elems: usize| {
                if staged(target) {
                    (0, 0)
                } else {
                    (target, (elems * 2) as i64)
                }
            };
            for (l, lw) in layers.iter().enumerate() {
                let gate_up = want(lw.gate_up, 2 * inter * h);
                let down = want(lw.down, h * inter);
                let next = layers
                    .get(l + 1)
                    .map_or((0, 0), |nl| want(nl.qkv, qkv_rows * h));
                assert_eq!(
                    &seen[3 * l..3 * l + 3],
                    &[
                        (Kernel::GemmTcAddNormSmall, lw.o, gate_up.0, gate_up.1),
                        (Kernel::GemmTcSiluSmall, lw.gate_up, down.0, down.1),
                        (Kernel::GemmTcAddNormSmall, lw.down, next.0, next.1),
                    ],
                    "layer {l}, staging budget {stage_bytes}"
                );
                if stage_bytes == 0 {
                    assert!(gate_up.0 != 0 && down.0 != 0, "layer {l}: all prefetched");
                } else {
                    assert_eq!(gate_up, (0, 0), "layer {l}: gate/up stages on 2 SMs");
                }
            }
        }
    }

    /// The tensor-core GEMM's epilogues: with every projection on it, the folded form (five
    /// launches a layer: the norms as prologues, RoPE/KV and the residual adds as epilogues);
    /// for a head size the QKV tile cannot pair, SiLU·up alone. The same logits as the
    /// launches apart, bit for bit, at a bucket of two token blocks.
    #[test]
    fn tc_epilogues_fold_the_layer_with_the_same_logits() {
        let qwen = synth_config(SynthArch::TinyQwen2);
        // head_dim 8: a 16-row tile cannot hold 8 rows and their RoPE partners.
        let narrow = ModelConfig {
            head_dim: 8,
            num_heads: 2 * qwen.num_heads,
            num_kv_heads: 2 * qwen.num_kv_heads,
            ..qwen.clone()
        };
        assert!(plan::tc_fold_fits(&qwen, GpuDtype::Bf16).is_ok());
        let e = plan::tc_fold_fits(&narrow, GpuDtype::Bf16).unwrap_err();
        assert!(e.contains("head_dim 8"), "{e}");
        for cfg in [qwen, narrow] {
            let (cfg, w) = synth_weights_for(cfg, 3, DType::F32);
            let lens: Vec<usize> = (0..12).map(|i| 1 + (i * 5) % 7).collect();
            let prompts = prompts(cfg.vocab_size, &lens);
            let blocks: Vec<Vec<u32>> = (0..prompts.len() as u32).map(|i| vec![i]).collect();
            let items = sampled(&prompts, &blocks, &vec![0; prompts.len()]);
            let tokens: usize = lens.iter().sum();
            assert!(tokens > plan::TC_TOKENS, "two token blocks");
            let mut logits = Vec::new();
            for on in [true, false] {
                // The wide tiles: 64 tokens would otherwise take the large ones.
                let mut m = EmuModel::new(cfg.clone(), &w, GpuDtype::Bf16, [16, 16, 64, 16], true)
                    .with_tc_epilogues(on)
                    .with_tc_fold_max_tokens(64)
                    .with_tc_large_min_tokens(0);
                let ops = m.plan().body(64);
                let count = |k: Kernel| {
                    ops.iter()
                        .filter(|op| matches!(op, Op::Launch { kernel, .. } if *kernel == k))
                        .count()
                };
                let layers = cfg.num_layers;
                let fold = on && cfg.head_dim == 16;
                let per = |yes: bool| if yes { layers } else { 0 };
                assert_eq!(count(Kernel::GemmTcRopeKv), per(fold));
                assert_eq!(count(Kernel::GemmTcAddNorm), 2 * per(fold));
                assert_eq!(count(Kernel::GemmTcSilu), per(on));
                assert_eq!(count(Kernel::SiluMul), per(!on));
                assert_eq!(count(Kernel::RopeKv), per(!fold));
                // The norms: the first layer's input norm and every layer's two apart (the
                // last one the final norm); folded, only the first (o and down norm at their
                // ends).
                assert_eq!(
                    count(Kernel::AddRmsNorm),
                    if fold { 1 } else { 2 * layers + 1 }
                );
                if fold {
                    // The embedding, the first norm, five a layer.
                    assert_eq!(ops.len(), 5 * layers + 2);
                }
                logits.push(m.step_logits(&items));
            }
            assert_eq!(logits[0], logits[1], "head_dim {}", cfg.head_dim);
        }
        // The fold stops at its bucket limit (4 tokens by default), and 0 turns it off.
        let (cfg, w) = synth_weights_for(synth_config(SynthArch::TinyQwen2), 3, DType::F32);
        let m = EmuModel::new(cfg, &w, GpuDtype::Bf16, [16, 16, 64, 16], true);
        assert!(m.plan().tc_fold(4) && !m.plan().tc_fold(8));
        let m = m.with_tc_fold_max_tokens(0);
        assert!(!m.plan().tc_fold(1));
        let m = m.with_tc_fold_max_tokens(8);
        assert!(m.plan().tc_fold(8) && !m.plan().tc_fold(16));
    }

    /// The split argmax (slices in their own blocks, the winners combined by the row's last
    /// block) gives bgs_argmax's id, which is the CPU's (the largest value, the lowest id among
    /// its ties, NaN never winning, 0 where nothing is above -inf), on rows whose ties straddle
    /// slices, whose maximum sits in the last, partial slice, and rows of NaN and -inf.
    #[test]
    fn split_argmax_gives_the_one_block_id() {
        let vocab = 1000; // slices of 32, the last of 8
        let mut rows: Vec<Vec<f32>> = Vec::new();
        let mut r = 12345u32;
        for _ in 0..6 {
            rows.push(
                (0..vocab)
                    .map(|_| {
                        r = r.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                        (r >> 8) as f32 / 65536.0 - 128.0
                    })
                    .collect(),
            );
        }
        let mut tie = vec![0.5f32; vocab];
        tie[900] = 3.0;
        tie[37] = 3.0;
        tie[999] = 3.0;
        rows.push(tie);
        let mut tail = vec![-1.0f32; vocab];
        tail[995] = 2.0;
        rows.push(tail);
        let mut nan = vec![f32::NAN; vocab];
        nan[640] = -5.0;
        nan[641] = -5.0;
        rows.push(nan);
        rows.push(vec![f32::NAN; vocab]);
        rows.push(vec![f32::NEG_INFINITY; vocab]);
        let mut one = vec![f32::NEG_INFINITY; vocab];
        one[3] = f32::MIN;
        rows.push(one);
        let cpu = |row: &[f32]| -> u32 {
            let mut best: Option<(f32, u32)> = None;
            for (i, &v) in row.iter().enumerate() {
                if v > best.map_or(f32::NEG_INFINITY, |b| b.0) {
                    best = Some((v, i as u32));
                }
            }
            best.map_or(0, |b| b.1)
        };
        let n = rows.len();
        let mut e = Emu::new(GpuDtype::Bf16);
        let logits = e.alloc(n * vocab * 4, "logits").unwrap();
        e.put_f32s(logits, &rows.concat());
        let next = e.alloc(n * 4, "next").unwrap();
        let cand = e.alloc(n * plan::ARGMAX_PARTS * 8, "cand").unwrap();
        let done = e.alloc(n * 4, "done").unwrap();
        let one_block = Op::Launch {
            kernel: Kernel::Argmax,
            grid: (n as u32, 1),
            block: plan::ARGMAX_THREADS,
            shared: 0,
            args: vec![Arg::P(logits), Arg::P(next), Arg::I(vocab as i32)],
        };
        let split = Op::Launch {
            kernel: Kernel::ArgmaxSplit,
            grid: (n as u32, plan::ARGMAX_PARTS as u32),
            block: plan::ARGMAX_SPLIT_THREADS,
            shared: 0,
            args: vec![
                Arg::P(logits),
                Arg::P(next),
                Arg::I(vocab as i32),
                Arg::P(cand),
                Arg::P(done),
            ],
        };
        let want: Vec<i32> = rows.iter().map(|r| cpu(r) as i32).collect();
        assert_eq!(&want[6..], &[37, 995, 640, 0, 0, 3]);
        for op in [one_block, split] {
            e.put_i32s(next, &vec![-1; n]);
            e.run(std::slice::from_ref(&op));
            assert_eq!(e.i32s(next, n), want);
        }
    }

    /// Staged small tiles: on the emulator's two multiprocessors the tiny Qwen2's small-tile
    /// GEMMs and SiLU tiles take several row tiles a block with their weights in shared memory
    /// (the emulator checks each launch's grid and room), and the logits of prefill and decode
    /// steps are those of the plan without staging.
    #[test]
    fn staged_small_tiles_plan_and_bits() {
        let (cfg, w) = synth_weights_for(synth_config(SynthArch::TinyQwen2), 5, DType::F32);
        let model = |bytes: usize| {
            EmuModel::new(cfg.clone(), &w, GpuDtype::Bf16, [16, 64, 64, 16], true)
                .with_tc_stage_bytes(bytes)
        };
        let staged = |m: &EmuModel, n: usize| -> Vec<Kernel> {
            m.plan()
                .body(n)
                .iter()
                .filter_map(|op| match op {
                    Op::Launch { kernel, shared, .. }
                        if plan::TC_STAGED_KERNELS.contains(kernel) && *shared > 0 =>
                    {
                        Some(*kernel)
                    }
                    _ => None,
                })
                .collect()
        };
        let on = model(plan::tc_stage_budget(232_448));
        let kinds = staged(&on, 1);
        assert!(kinds.contains(&Kernel::GemmTcSiluSmall), "{kinds:?}");
        assert!(staged(&model(0), 1).is_empty());
        assert!(
            staged(&on, 32).is_empty(),
            "the wide tiles are never staged"
        );
        for b in [1usize, 3, 8] {
            let lens: Vec<usize> = (0..b).map(|i| 2 + i % 3).collect();
            let prompts = prompts(cfg.vocab_size, &lens);
            let blocks: Vec<Vec<u32>> = (0..b as u32).map(|i| vec![i]).collect();
            let mut logits = Vec::new();
            for bytes in [plan::tc_stage_budget(232_448), 0] {
                let mut m = model(bytes);
                let first = m.step_logits(&sampled(&prompts, &blocks, &vec![0; b]));
                let next: Vec<Vec<u32>> = (0..b as u32)
                    .map(|i| vec![(5 * i + 2) % cfg.vocab_size as u32])
                    .collect();
                logits.push((first, m.step_logits(&sampled(&next, &blocks, &lens))));
            }
            assert_eq!(logits[0], logits[1], "batch {b}");
        }
    }

    /// The small tensor-core tiles: buckets of at most `TC_SMALL_TOKENS` tokens (and LM heads
    /// of at most that many rows; or up to 16 tokens, in two token blocks) launch the `_small`
    /// entry points with token blocks of that width, larger ones the wide tiles, in the apart
    /// and the folded form; the emulated
    /// logits are those of the wide tiles (the emulator checks every grid against its
    /// kernel's tile width).
    #[test]
    fn small_tensor_core_tiles_plan_and_bits() {
        let (cfg, w) = synth_weights_for(synth_config(SynthArch::TinyQwen2), 3, DType::F32);
        let small = [
            Kernel::GemmTcSmall,
            Kernel::GemmTcSiluSmall,
            Kernel::GemmTcAddNormSmall,
            Kernel::GemmTcRopeKvSmall,
        ];
        for (fold, max) in [(false, 8), (true, 8), (false, 16), (true, 16)] {
            let model = |max: usize| {
                // The small tiles alone: 16 tokens would otherwise take the mid tiles.
                EmuModel::new(cfg.clone(), &w, GpuDtype::Bf16, [16, 64, 64, 16], true)
                    .with_tc_fold_max_tokens(if fold { 64 } else { 0 })
                    .with_tc_small_max_tokens(max)
                    .with_tc_mid_max_tokens(0)
            };
            let m = model(max);
            for n in [1, 8, 16, 32] {
                let plan = m.plan();
                let ops = [plan.body(n), plan.head(n)].concat();
                let tc: Vec<(Kernel, u32)> = ops
                    .iter()
                    .filter_map(|op| match op {
                        Op::Launch { kernel, grid, .. } if kernel.tc_tile_tokens().is_some() => {
                            Some((*kernel, grid.1))
                        }
                        _ => None,
                    })
                    .collect();
                assert!(!tc.is_empty());
                for (k, gy) in tc {
                    let want = if n <= max { k.wide().small() } else { k.wide() };
                    assert_eq!(k, want, "bucket {n}, fold {fold}, small to {max}");
                    assert_eq!(small.contains(&k), n <= max);
                    assert_eq!(gy as usize, n.div_ceil(k.tc_tile_tokens().unwrap()));
                }
            }
            let ops = model(0).plan().body(1);
            assert!(
                ops.iter()
                    .all(|op| !matches!(op, Op::Launch { kernel, .. } if small.contains(kernel)))
            );
            // Decode steps of 1, 3, 8 and 16 sequences after a prefill, small tiles on and off.
            for b in [1usize, 3, 8, 16] {
                let lens: Vec<usize> = (0..b).map(|i| 2 + i % 3).collect();
                let prompts = prompts(cfg.vocab_size, &lens);
                let blocks: Vec<Vec<u32>> = (0..b as u32).map(|i| vec![i]).collect();
                let mut logits = Vec::new();
                for small_max in [max, 0] {
                    let mut m = model(small_max);
                    let first = m.step_logits(&sampled(&prompts, &blocks, &vec![0; b]));
                    let next: Vec<Vec<u32>> = (0..b as u32)
                        .map(|i| vec![(7 * i + 1) % cfg.vocab_size as u32])
                        .collect();
                    logits.push((first, m.step_logits(&sampled(&next, &blocks, &lens))));
                }
                assert_eq!(
                    logits[0], logits[1],
                    "batch {b}, fold {fold}, small to {max}"
                );
            }
        }
    }

    /// The mid tensor-core tiles, on: buckets of more than `TC_SMALL_TOKENS` and at most
    /// `TC_MID_TOKENS` tokens (and LM heads of that many rows) launch the `_mid` entry points in
    /// one token block, smaller ones keep the small tiles (where those are on) and larger ones
    /// the wide tiles, in the apart and the folded form; the mid SiLU GEMM stages on the
    /// emulator's two multiprocessors as the small one does. Off (`with_tc_mid_max_tokens(0)`),
    /// no bucket launches them.
    #[test]
    fn mid_tensor_core_tiles_are_planned_past_the_small_width() {
        let (cfg, w) = synth_weights_for(synth_config(SynthArch::TinyQwen2), 3, DType::F32);
        let mid = [
            Kernel::GemmTcMid,
            Kernel::GemmTcSiluMid,
            Kernel::GemmTcAddNormMid,
            Kernel::GemmTcRopeKvMid,
        ];
        let tc_launches = |m: &EmuModel, n: usize| -> Vec<(Kernel, u32, u32)> {
            let plan = m.plan();
            [plan.body(n), plan.head(n)]
                .concat()
                .iter()
                .filter_map(|op| match op {
                    Op::Launch {
                        kernel,
                        grid,
                        shared,
                        ..
                    } if kernel.tc_tile_tokens().is_some() => Some((*kernel, grid.1, *shared)),
                    _ => None,
                })
                .collect()
        };
        for (fold, small_max) in [(false, 16), (true, 16), (false, 0), (true, 0)] {
            let m = EmuModel::new(cfg.clone(), &w, GpuDtype::Bf16, [16, 64, 64, 16], true)
                .with_tc_fold_max_tokens(if fold { 64 } else { 0 })
                .with_tc_small_max_tokens(small_max)
                .with_tc_mid_max_tokens(plan::TC_MID_TOKENS);
            for n in [1, 8, 16, 32] {
                let tc = tc_launches(&m, n);
                assert!(!tc.is_empty());
                let on_mid = n > plan::TC_SMALL_TOKENS && n <= plan::TC_MID_TOKENS;
                for &(k, gy, _) in &tc {
                    let want = if on_mid {
                        k.wide().mid()
                    } else if n <= small_max {
                        k.wide().small()
                    } else {
                        k.wide()
                    };
                    assert_eq!(k, want, "bucket {n}, fold {fold}, small to {small_max}");
                    assert_eq!(mid.contains(&k), on_mid);
                    assert_eq!(gy as usize, n.div_ceil(k.tc_tile_tokens().unwrap()));
                }
                if n == plan::TC_MID_TOKENS {
                    // One token block, the LM head's 16 rows included; the gate/up tiles stage.
                    assert!(tc.iter().all(|&(_, gy, _)| gy == 1));
                    assert!(tc.iter().any(|&(k, _, _)| k == Kernel::GemmTcMid));
                    assert!(
                        tc.iter()
                            .any(|&(k, _, shared)| k == Kernel::GemmTcSiluMid && shared > 0),
                        "{tc:?}"
                    );
                }
            }
        }
        let off = EmuModel::new(cfg.clone(), &w, GpuDtype::Bf16, [16, 64, 64, 16], true)
            .with_tc_mid_max_tokens(0);
        for n in [1, 8, 16, 32] {
            assert!(tc_launches(&off, n).iter().all(|(k, ..)| !mid.contains(k)));
        }
    }

    /// The mid tensor-core tiles give exactly the bits of the small tiles (two 8-token blocks)
    /// and of the wide ones on steps of 9 to 16 tokens: prefill steps of 9 and 16 tokens, and
    /// decode steps of 9, 12 and 16 sequences, apart and folded, staged (the emulator's two
    /// multiprocessors) and not.
    #[test]
    fn mid_tensor_core_tiles_give_the_bits_of_small_and_wide_tiles() {
        let (cfg, w) = synth_weights_for(synth_config(SynthArch::TinyQwen2), 3, DType::F32);
        let cases: [Vec<usize>; 5] = [
            vec![5, 11],
            vec![4, 5],
            vec![1; 9],
            (0..12).map(|i| 1 + i % 2).collect(),
            vec![1; 16],
        ];
        for (fold, stage) in [(false, true), (true, true), (false, false)] {
            let model = |small_max: usize, mid_max: usize| {
                EmuModel::new(cfg.clone(), &w, GpuDtype::Bf16, [16, 64, 64, 16], true)
                    .with_tc_fold_max_tokens(if fold { 64 } else { 0 })
                    .with_tc_stage_bytes(if stage {
                        plan::tc_stage_budget(232_448)
                    } else {
                        0
                    })
                    .with_tc_small_max_tokens(small_max)
                    .with_tc_mid_max_tokens(mid_max)
            };
            for lens in &cases {
                let b = lens.len();
                let prompts = prompts(cfg.vocab_size, lens);
                let blocks: Vec<Vec<u32>> = (0..b as u32).map(|i| vec![i]).collect();
                let next: Vec<Vec<u32>> = (0..b as u32)
                    .map(|i| vec![(7 * i + 1) % cfg.vocab_size as u32])
                    .collect();
                // Mid tiles, small tiles, wide tiles.
                let mut logits = Vec::new();
                for (small_max, mid_max) in [(16, plan::TC_MID_TOKENS), (16, 0), (0, 0)] {
                    let mut m = model(small_max, mid_max);
                    let first = m.step_logits(&sampled(&prompts, &blocks, &vec![0; b]));
                    logits.push((first, m.step_logits(&sampled(&next, &blocks, lens))));
                }
                let what = format!("prompts {lens:?}, fold {fold}, staged {stage}");
                assert_eq!(logits[0], logits[1], "mid vs small tiles, {what}");
                assert_eq!(logits[0], logits[2], "mid vs wide tiles, {what}");
            }
        }
    }

    /// The large tensor-core tiles: buckets of at least `tc_large_min_tokens` tokens (and LM
    /// heads of at least that many rows) launch `bgs_gemm_tc_large` for the plain GEMMs and
    /// `bgs_gemm_tc_silu_large` for the gate/up SiLU GEMM, apart and folded, before the mid
    /// and small tiles would take the bucket; the add-norm and RoPE/KV forms keep their tiles,
    /// and smaller buckets the wide, mid and small tiles as before. Every large launch is one
    /// 256-thread block a 64-token block and a block of 64 rows (32 gate/up units), with the
    /// pipeline's dynamic shared memory (the emulator's `check_tc` checks the grid covers the
    /// rows). 0: none.
    #[test]
    fn large_tensor_core_tiles_are_planned_from_their_min_tokens() {
        let (cfg, w) = synth_weights_for(synth_config(SynthArch::TinyQwen2), 3, DType::F32);
        let d = crate::GpuModelOptions::default();
        let (small_max, mid_max) = (
            d.tensor_core_small_tiles_max_tokens,
            d.tensor_core_mid_tiles_max_tokens,
        );
        let vocab = cfg.vocab_size;
        // (kernel, grid, block, shared, rows: the `out` or `inter` argument)
        type TcLaunch = (Kernel, (u32, u32), u32, u32, usize);
        let tc_launches = |m: &EmuModel, n: usize| -> Vec<TcLaunch> {
            let plan = m.plan();
            [plan.body(n), plan.head(n)]
                .concat()
                .iter()
                .filter_map(|op| match op {
                    Op::Launch {
                        kernel,
                        grid,
                        block,
                        shared,
                        args,
                    } if kernel.tc_tile_tokens().is_some() => {
                        let rows = match args[3] {
                            Arg::I(r) => r as usize,
                            _ => 0,
                        };
                        Some((*kernel, *grid, *block, *shared, rows))
                    }
                    _ => None,
                })
                .collect()
        };
        for (fold, epilogues) in [(false, true), (true, true), (false, false)] {
            for min in [plan::TC_LARGE_TOKENS, 32, 1, 0] {
                let m = EmuModel::new(cfg.clone(), &w, GpuDtype::Bf16, [16, 64, 512, 512], true)
                    .with_tc_fold_max_tokens(if fold { 512 } else { 0 })
                    .with_tc_epilogues(epilogues)
                    .with_tc_large_min_tokens(min)
                    .with_tc_large_split(0);
                let sms = m.plan().sms as usize;
                for n in [1, 8, 16, 32, 64, 128, 256, 512] {
                    let tc = tc_launches(&m, n);
                    assert!(!tc.is_empty());
                    let on = min > 0 && n >= min;
                    let what = format!("bucket {n}, min {min}, fold {fold}, epilogues {epilogues}");
                    for &(k, (gx, gy), block, shared, rows) in &tc {
                        let wide = k.wide();
                        // Large only where the large grid has a block a multiprocessor
                        // (`Plan::tc_kernel_over`).
                        let fills = |units: usize| {
                            rows.div_ceil(units) * n.div_ceil(plan::TC_LARGE_TOKENS) >= sms
                        };
                        let want = if on
                            && matches!(wide, Kernel::GemmTc | Kernel::GemmTcSilu)
                            && fills(wide.large().tc_tile_rows().unwrap())
                        {
                            wide.large()
                        } else if n > plan::TC_SMALL_TOKENS && n <= mid_max {
                            wide.mid()
                        } else if n <= small_max {
                            wide.small()
                        } else {
                            wide
                        };
                        assert_eq!(k, want, "{what}");
                        assert_eq!(gy as usize, n.div_ceil(k.tc_tile_tokens().unwrap()));
                        if k.is_tc_large() {
                            // 64 rows a block (32 gate/up units for the SiLU form): one
                            // 256-thread block of 8 warps, the pipeline's shared memory.
                            let units = k.tc_tile_rows().unwrap();
                            assert_eq!(gx as usize, rows.div_ceil(units), "{what}: {k:?}");
                            assert_eq!(block as usize, plan::TC_WARPS * 32, "{what}");
                            assert_eq!(shared as usize, plan::tc_large_shared_bytes(), "{what}");
                        }
                    }
                    let kinds: Vec<Kernel> = tc.iter().map(|&(k, ..)| k).collect();
                    // The LM head is a plain GEMM in either form; gate/up runs the SiLU GEMM
                    // where the epilogues are on, the plain one otherwise.
                    assert_eq!(kinds.contains(&Kernel::GemmTcLarge), on, "{what}");
                    assert_eq!(
                        kinds.contains(&Kernel::GemmTcSiluLarge),
                        on && epilogues,
                        "{what}"
                    );
                }
            }
        }
        // The LM head alone: its rows (sampled rows) decide, as a bucket's tokens do.
        let m = EmuModel::new(cfg.clone(), &w, GpuDtype::Bf16, [16, 64, 512, 512], true)
            .with_tc_large_min_tokens(plan::TC_LARGE_TOKENS);
        for (s, large) in [(32, false), (64, true), (512, true)] {
            let head = m.plan().head(s);
            let Some(Op::Launch { kernel, grid, .. }) = head.iter().find(
                |op| matches!(op, Op::Launch { kernel, .. } if kernel.tc_tile_tokens().is_some()),
            ) else {
                panic!("no tensor-core LM head at {s}");
            };
            assert_eq!(*kernel == Kernel::GemmTcLarge, large, "LM head of {s}");
            if large {
                assert_eq!(
                    *grid,
                    (
                        vocab.div_ceil(plan::TC_LARGE_ROWS) as u32,
                        s.div_ceil(plan::TC_LARGE_TOKENS) as u32
                    )
                );
            }
        }
    }

    /// The large tensor-core tiles give exactly the bits of the wide ones: prefill steps of 64
    /// tokens (30 + 34) and 100 (37 + 63: the 128-token bucket, its second token block part
    /// padding), each followed by a decode step, and decode steps of 64 and 70 sequences (70:
    /// the bucket of 128, and an LM head of 128 rows), apart and folded, and with the gate/up
    /// projection on the plain GEMM (epilogues off).
    #[test]
    fn large_tensor_core_tiles_give_the_bits_of_wide_tiles() {
        let (cfg, w) = synth_weights_for(synth_config(SynthArch::TinyQwen2), 3, DType::F32);
        let cases: [Vec<usize>; 4] = [
            vec![30, 34],
            vec![37, 63],
            vec![1; 64],
            (0..70).map(|i| 1 + i % 2).collect(),
        ];
        // Blocks a sequence: 63 prompt tokens and a decode token, 16 positions a block.
        let per = 5u32;
        for (fold, epilogues) in [(false, true), (true, true), (false, false)] {
            let model = |min: usize| {
                EmuModel::new(
                    cfg.clone(),
                    &w,
                    GpuDtype::Bf16,
                    [16, 70 * per as usize, 128, 128],
                    true,
                )
                .with_tc_fold_max_tokens(if fold { 128 } else { 0 })
                .with_tc_epilogues(epilogues)
                .with_tc_large_min_tokens(min)
            };
            // (The large tiles are planned at both buckets, the wide ones without them.)
            for n in [64, 128] {
                let large = |m: &EmuModel| {
                    let p = m.plan();
                    [p.body(n), p.head(n)]
                        .concat()
                        .iter()
                        .any(|op| matches!(op, Op::Launch { kernel, .. } if kernel.is_tc_large()))
                };
                assert!(large(&model(plan::TC_LARGE_TOKENS)));
                assert!(!large(&model(0)));
            }
            for lens in &cases {
                let b = lens.len();
                // Large tiles from 64 tokens, then none.
                let mut logits = Vec::new();
                for min in [plan::TC_LARGE_TOKENS, 0] {
                    logits.push(prefill_then_decode_logits(&mut model(min), lens, per));
                }
                let tokens: usize = lens.iter().sum();
                assert_eq!(
                    logits[0], logits[1],
                    "large vs wide tiles, {b} prompts of {tokens} tokens, fold {fold}, \
                     epilogues {epilogues}"
                );
            }
        }
    }

    /// The split large tiles where a projection's large grid is short of the multiprocessors
    /// and its split grid is not (`Plan::tc_kernel_over`), on 2 multiprocessors (o_proj and
    /// down_proj: one tile at 64 tokens), on 5 (gate/up's 4 tiles at 64 tokens and QKV's at
    /// 128, a tile short of the scratch `GpuModel::new` sizes; at 128 down_proj's 2 tiles
    /// over 3 or 4 groups, not 2) and on 8 (at 64 tokens gate/up alone; at 128 QKV, and
    /// down_proj over 4 groups), with
    /// 8 class groups (a class a block), 3 (3, 3 and 2 classes) and 2: the logits of prefill
    /// and decode steps over the 64- and 128-token buckets equal those of the large tiles
    /// unsplit (the wide tiles where their grid is short) and of the wide tiles alone, bit for
    /// bit, apart and folded, with the gate/up projection on the plain GEMM (epilogues off)
    /// too. The emulator takes each split tile block by block through the scratch.
    #[test]
    fn split_large_tensor_core_tiles_give_the_bits_of_wide_tiles() {
        let (cfg, w) = synth_weights_for(synth_config(SynthArch::TinyQwen2), 3, DType::F32);
        let cases: [Vec<usize>; 3] = [
            vec![30, 34],
            vec![37, 63],
            (0..70).map(|i| 1 + i % 2).collect(),
        ];
        let per = 5u32;
        for (fold, epilogues) in [(false, true), (true, true), (false, false)] {
            for sms in [2, 5, 8] {
                let model = |min: usize, groups: usize| {
                    EmuModel::new(
                        cfg.clone(),
                        &w,
                        GpuDtype::Bf16,
                        [16, 70 * per as usize, 128, 128],
                        true,
                    )
                    .with_tc_fold_max_tokens(if fold { 128 } else { 0 })
                    .with_tc_epilogues(epilogues)
                    .with_tc_large_min_tokens(min)
                    .with_sms(sms)
                    .with_tc_large_split(groups)
                };
                let what = format!("{sms} SMs, fold {fold}, epilogues {epilogues}");
                // Split launches at 64 tokens (folded, on 8 multiprocessors: gate/up alone).
                let split = |m: &EmuModel, n: usize| {
                    let p = m.plan();
                    [p.body(n), p.head(n)].concat().iter().any(
                        |op| matches!(op, Op::Launch { kernel, .. } if kernel.is_tc_large_split()),
                    )
                };
                let large = model(plan::TC_LARGE_TOKENS, 8);
                assert_eq!(split(&large, 64), !fold || sms > 4, "{what}");
                assert!(!split(&model(plan::TC_LARGE_TOKENS, 0), 64), "{what}");
                assert!(!split(&model(0, 8), 64), "{what}");
                for lens in &cases {
                    let b = lens.len();
                    // Split in 8, 3 and 2; unsplit; the wide tiles alone.
                    let mut logits = Vec::new();
                    for (min, groups) in [
                        (plan::TC_LARGE_TOKENS, 8),
                        (plan::TC_LARGE_TOKENS, 3),
                        (plan::TC_LARGE_TOKENS, 2),
                        (plan::TC_LARGE_TOKENS, 0),
                        (0, 0),
                    ] {
                        let mut m = model(min, groups);
                        logits.push(prefill_then_decode_logits(&mut m, lens, per));
                        // Every tile's count is back to zero.
                        let tiles = split_tiles(groups, sms);
                        assert!(
                            m.emu
                                .i32s(m.b.split_done, tiles.max(1))
                                .iter()
                                .all(|&c| c == 0)
                        );
                    }
                    let tokens: usize = lens.iter().sum();
                    for (i, l) in logits.iter().enumerate().skip(1) {
                        assert_eq!(
                            logits[0], *l,
                            "split in 8 vs form {i}, {b} prompts of {tokens} tokens, {what}"
                        );
                    }
                }
            }
        }
    }

    /// Which form each projection runs with the split large tiles: the large tiles where their
    /// grid has a block a multiprocessor, split over the groups (2 or more) where it has fewer
    /// but its tiles times the groups have a block a multiprocessor, the wide, mid or small
    /// tiles there without split (0 or 1 groups, or a split grid short of the
    /// multiprocessors), on 2, 8 and 32 multiprocessors; a split launch's grid is its tiles
    /// (fewer than the multiprocessors) times the groups in x (at least a block a
    /// multiprocessor in all) and a block a 64-token block in y, 256 threads, the large tiles'
    /// shared memory, and its arguments the large form's then the scratch and the groups.
    #[test]
    fn split_large_tensor_core_tiles_are_planned_where_the_large_grid_is_short() {
        let (cfg, w) = synth_weights_for(synth_config(SynthArch::TinyQwen2), 3, DType::F32);
        let d = crate::GpuModelOptions::default();
        let (small_max, mid_max) = (
            d.tensor_core_small_tiles_max_tokens,
            d.tensor_core_mid_tiles_max_tokens,
        );
        let mut seen = Vec::new();
        // Short large grids whose split grid is short too: unsplit.
        let mut short_unsplit = 0;
        for (fold, epilogues) in [(false, true), (true, true), (false, false)] {
            for sms in [2, 8, 32] {
                for groups in [0, 1, 3, 8] {
                    let m =
                        EmuModel::new(cfg.clone(), &w, GpuDtype::Bf16, [16, 64, 512, 512], true)
                            .with_tc_fold_max_tokens(if fold { 512 } else { 0 })
                            .with_tc_epilogues(epilogues)
                            .with_sms(sms)
                            .with_tc_large_split(groups);
                    let plan = m.plan();
                    for n in [1, 8, 16, 32, 64, 128, 256, 512] {
                        let what = format!(
                            "bucket {n}, {sms} SMs, {groups} groups, fold {fold}, \
                             epilogues {epilogues}"
                        );
                        for op in [plan.body(n), plan.head(n)].concat() {
                            let Op::Launch {
                                kernel: k,
                                grid: (gx, gy),
                                block,
                                shared,
                                args,
                            } = op
                            else {
                                continue;
                            };
                            if k.tc_tile_tokens().is_none() {
                                continue;
                            }
                            // (`out` or `inter`; the RoPE/KV form, never large, has none
                            // there.)
                            let rows = match args[3] {
                                Arg::I(r) => r as usize,
                                _ => 0,
                            };
                            let wide = k.wide();
                            let tiles = |units: usize| {
                                rows.div_ceil(units) * n.div_ceil(plan::TC_LARGE_TOKENS)
                            };
                            let large = matches!(wide, Kernel::GemmTc | Kernel::GemmTcSilu)
                                && n >= plan::TC_LARGE_TOKENS;
                            // At most a block a chunk of the input (`in`; the emulator's
                            // plans split down to one chunk a block).
                            let groups = match args[4] {
                                Arg::I(inp) => groups.min(inp as usize / plan::TC_CHUNK),
                                _ => 0,
                            };
                            let large_tiles = if large {
                                tiles(wide.large().tc_tile_rows().unwrap())
                            } else {
                                0
                            };
                            let want = if large && large_tiles >= sms as usize {
                                wide.large()
                            } else if large && groups >= 2 && large_tiles * groups >= sms as usize {
                                wide.large().split()
                            } else if n > plan::TC_SMALL_TOKENS && n <= mid_max {
                                wide.mid()
                            } else if n <= small_max {
                                wide.small()
                            } else {
                                wide
                            };
                            assert_eq!(k, want, "{what}");
                            if large
                                && large_tiles < sms as usize
                                && groups >= 2
                                && large_tiles * groups < sms as usize
                            {
                                short_unsplit += 1;
                            }
                            if !k.is_tc_large_split() {
                                continue;
                            }
                            seen.push(k);
                            let units = k.tc_tile_rows().unwrap();
                            assert!(tiles(units) < sms as usize, "{what}: {k:?}");
                            // Never a split grid short of the multiprocessors.
                            assert!(gx as usize * gy as usize >= sms as usize, "{what}: {k:?}");
                            assert_eq!(
                                (gx as usize, gy as usize),
                                (
                                    rows.div_ceil(units) * groups,
                                    n.div_ceil(plan::TC_LARGE_TOKENS)
                                ),
                                "{what}: {k:?}"
                            );
                            assert_eq!(block as usize, plan::TC_WARPS * 32, "{what}");
                            assert_eq!(shared as usize, plan::tc_large_shared_bytes(), "{what}");
                            let at = if wide == Kernel::GemmTcSilu { 8 } else { 6 };
                            assert_eq!(
                                args[at..],
                                [
                                    Arg::P(m.b.split_part),
                                    Arg::P(m.b.split_done),
                                    Arg::I(groups as i32)
                                ],
                                "{what}"
                            );
                        }
                    }
                }
            }
        }
        for k in [Kernel::GemmTcLargeSplit, Kernel::GemmTcSiluLargeSplit] {
            assert!(seen.contains(&k), "{k:?} never planned");
        }
        assert!(short_unsplit > 0, "no short split grid left unsplit");
    }

    /// What the emulator requires of a split launch, as the kernel would misbehave without it:
    /// (the plain GEMM's on 4 multiprocessors: QKV, two tiles at 64 tokens, planned over 2
    /// blocks a tile, a block a multiprocessor; on 8 its 4 blocks would not split) groups 2..=8 in
    /// the last argument, a grid of whole tiles of that many blocks covering the rows exactly,
    /// 256 threads, the large tiles' shared memory, a count of zero a tile at launch, and a
    /// scratch of 8 class sums a tile for every tile (one tile short runs past it). A launch
    /// that passes leaves every count at zero and the class sums of the input's chunks in the
    /// scratch (the emulated TinyQwen2's 64-wide input: classes 0 and 1).
    #[test]
    fn split_large_tile_launches_check_their_geometry_and_scratch() {
        let (cfg, w) = synth_weights_for(synth_config(SynthArch::TinyQwen2), 3, DType::F32);
        let sms = 4;
        let mut m = EmuModel::new(cfg.clone(), &w, GpuDtype::Bf16, [16, 64, 128, 64], true)
            .with_sms(sms)
            .with_tc_large_split(8);
        // Real activations first: a prefill of 64 tokens (QKV split).
        let p = prompts(cfg.vocab_size, &[64]);
        let blocks = vec![(0..5).collect::<Vec<u32>>()];
        m.step_logits(&sampled(&p, &blocks, &[0]));
        let qkv = m
            .plan()
            .body(64)
            .into_iter()
            .find(|op| {
                matches!(
                    op,
                    Op::Launch {
                        kernel: Kernel::GemmTcLargeSplit,
                        ..
                    }
                )
            })
            .unwrap();
        let Op::Launch {
            kernel,
            grid,
            block,
            shared,
            ref args,
        } = qkv
        else {
            unreachable!()
        };
        let qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim;
        assert_eq!(args[3], Arg::I(qkv_rows as i32));
        // Planned over as many blocks a tile as the input has chunks (2: at most one a chunk,
        // `Plan::tc_large_split_groups`); launched here over 8, which the kernel takes too.
        let groups = (cfg.hidden_size / plan::TC_CHUNK).min(8);
        assert_eq!(grid, (2 * groups as u32, 1));
        assert!(grid.0 * grid.1 >= sms, "a block a multiprocessor");
        assert_eq!(args[8], Arg::I(groups as i32));
        let mut args = args.clone();
        args[8] = Arg::I(8);
        let args = &args;
        let grid = (2 * 8, 1);
        // As planned: passes, the counts back at zero, the class sums in the scratch (cleared
        // of the step's: down_proj's 128-wide input has 4 classes).
        let per_class = plan::TC_LARGE_SPLIT_PART_BYTES / 4;
        m.emu
            .put_f32s(m.b.split_part, &vec![0.0; 2 * 8 * per_class]);
        m.emu.launch(kernel, grid, block, shared, args);
        assert!(
            m.emu
                .i32s(m.b.split_done, sms as usize)
                .iter()
                .all(|&c| c == 0)
        );
        let part = m.emu.f32s(m.b.split_part, 2 * 8 * per_class);
        for (i, class) in part.chunks_exact(per_class).enumerate() {
            let written = class.iter().any(|&v| v != 0.0);
            assert_eq!(
                written,
                i % 8 < cfg.hidden_size / plan::TC_CHUNK,
                "class {i}"
            );
        }
        let launch = |m: &mut EmuModel, grid, block, shared, args: &[Arg]| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                m.emu.launch(kernel, grid, block, shared, args)
            }))
            .is_ok()
        };
        let with_groups = |g: i32| {
            let mut a = args.clone();
            a[8] = Arg::I(g);
            a
        };
        assert!(launch(&mut m, grid, block, shared, args));
        for (g, gx) in [(1, 2), (1, 16), (0, 16), (9, 18), (4, 16), (-8, 16)] {
            assert!(
                !launch(&mut m, (gx, 1), block, shared, &with_groups(g)),
                "{g} groups, {gx} blocks"
            );
        }
        // Fewer groups, the grid to match: passes (the plan's only in its argument).
        assert!(launch(&mut m, (2 * 3, 1), block, shared, &with_groups(3)));
        assert!(
            !launch(&mut m, (2 * 8 + 1, 1), block, shared, args),
            "a partial tile"
        );
        assert!(
            !launch(&mut m, (3 * 8, 1), block, shared, args),
            "a tile past the rows"
        );
        assert!(!launch(&mut m, (8, 1), block, shared, args), "rows missed");
        assert!(!launch(&mut m, grid, 512, shared, args), "512 threads");
        assert!(!launch(&mut m, grid, block, 0, args), "no shared memory");
        // A count left over from before.
        m.emu.put_i32s(m.b.split_done + 4, &[1]);
        assert!(
            !launch(&mut m, grid, block, shared, args),
            "a count at launch"
        );
        m.emu.put_i32s(m.b.split_done + 4, &[0]);
        assert!(launch(&mut m, grid, block, shared, args));
        // A scratch of one tile, as a device of a multiprocessor would have: runs past it.
        for (tiles, ok) in [(1, false), (2, true)] {
            let b = plan::alloc_bufs(
                &mut m.emu,
                &m.cfg,
                m.geo.max_tokens,
                m.geo.max_samples,
                m.dtype,
                tiles,
            )
            .unwrap();
            let mut a = args.clone();
            a[6] = Arg::P(b.split_part);
            a[7] = Arg::P(b.split_done);
            assert_eq!(launch(&mut m, grid, block, shared, &a), ok, "{tiles} tiles");
        }
    }

    /// The split form's scratch layout (`gemm_tc_large_body`'s fragments, [`tcl_fragment`]):
    /// a class of a tile is 256 threads' 2 x `TC_LARGE_WARP_TOKENS / 8` float4s, every one of
    /// `TC_LARGE_SPLIT_PART_BYTES` written once, holding each output of the tile's 64 rows x 64
    /// tokens once; in the SiLU form m 0 holds 32 gate units x 64 tokens once each and m 1 the
    /// same units' up rows (16 rows further in the block).
    #[test]
    fn split_part_layout_holds_each_output_of_a_tile_once() {
        let nt = plan::TC_LARGE_WARP_TOKENS / 8;
        let (rows, tokens) = (plan::TC_LARGE_ROWS, plan::TC_LARGE_TOKENS);
        let mut at = vec![0u8; plan::TC_LARGE_SPLIT_PART_BYTES / 4];
        let mut out = vec![0u8; rows * tokens];
        let mut units = vec![0u8; rows / 2 * tokens];
        for tid in 0..plan::TC_WARPS * 32 {
            for m in 0..2 {
                for j in 0..nt {
                    for k in 0..4 {
                        at[((m * nt + j) * plan::TC_WARPS * 32 + tid) * 4 + k] += 1;
                        let (i, t) = tcl_fragment(tid, m, j, k);
                        out[i * tokens + t] += 1;
                        assert_eq!(i % 32 >= 16, m == 1);
                        if m == 0 {
                            units[((i / 32) * 16 + i % 16) * tokens + t] += 1;
                            assert_eq!(tcl_fragment(tid, 1, j, k), (i + 16, t));
                        }
                    }
                }
            }
        }
        assert!(at.iter().all(|&c| c == 1));
        assert!(out.iter().all(|&c| c == 1));
        assert!(units.iter().all(|&c| c == 1));
    }

    /// The persistent form takes every op of the own-kernel plans (the invariant tensor-core
    /// form, the fused form, f32's invariant form) at every bucket, refuses the cuBLAS plan,
    /// and its table decodes back to the very ops (each argument in its signature's kind).
    #[test]
    fn persistent_tables_round_trip_every_own_kernel_plan() {
        use crate::persistent;
        for (arch, dtype, inv, fused) in [
            (SynthArch::TinyQwen2, GpuDtype::Bf16, true, 0),
            (SynthArch::TinyLlama, GpuDtype::F32, true, 0),
            // The fused form's buckets, with the LM head on the tensor-core GEMM (cuBLAS's
            // otherwise).
            (SynthArch::TinyQwen2, GpuDtype::F16, false, 8),
        ] {
            let (cfg, w) = synth_weights_for(synth_config(arch), 1, DType::F32);
            // SiLU·up apart from the gate/up GEMM and the wide tiles alone, as `GpuModel`
            // builds its tables.
            let mut m = EmuModel::new(cfg, &w, dtype, [16, 8, 64, 8], inv)
                .with_attention_warps(4)
                .with_tc_epilogues(false)
                .with_tc_small_max_tokens(0)
                .with_tc_mid_max_tokens(0)
                .with_tc_large_min_tokens(0)
                .with_split_argmax(false);
            if fused > 0 {
                m = m.with_fused_max_tokens(fused).with_tc_gemm_max_tokens(8);
            }
            let buckets: &[usize] = if fused > 0 { &[1, 8] } else { &[1, 8, 64] };
            for &n in buckets {
                for ops in [m.plan().body(n), m.plan().head(n.min(8))] {
                    let recs = persistent::encode(&ops, dtype, 1)
                        .unwrap_or_else(|e| panic!("{arch:?} {dtype:?} bucket {n}: {e}"));
                    let kinds: Vec<Vec<char>> = recs
                        .iter()
                        .map(|r| signature(Kernel::ALL[r.kernel as usize].name()))
                        .collect();
                    assert_eq!(persistent::decode(&recs, &kinds), ops);
                    assert_eq!(
                        persistent::table_bytes(&recs).len(),
                        recs.len() * persistent::RECORD_BYTES
                    );
                    // Every projection's weights are prefetched one op ahead.
                    let weighted = ops
                        .iter()
                        .skip(1)
                        .filter(|op| {
                            matches!(
                                op,
                                Op::Launch {
                                    kernel: Kernel::GemmTc
                                        | Kernel::GemmTcSilu
                                        | Kernel::Proj
                                        | Kernel::ProjAdd
                                        | Kernel::ProjNormSilu
                                        | Kernel::ProjNormRopeKv,
                                    ..
                                }
                            )
                        })
                        .count();
                    assert_eq!(recs.iter().filter(|r| r.pf_bytes > 0).count(), weighted);
                }
            }
        }
        let (cfg, w) = synth_weights_for(synth_config(SynthArch::TinyQwen2), 1, DType::F32);
        let m = EmuModel::new(cfg, &w, GpuDtype::Bf16, [16, 8, 64, 8], false);
        let e = persistent::encode(&m.plan().body(8), GpuDtype::Bf16, 1).unwrap_err();
        assert!(e.contains("cuBLAS GEMM (qkv)"), "{e}");
        // The folded form's kernels (two warp groups, normed rows in shared memory) are not
        // persistent bodies.
        let (cfg, w) = synth_weights_for(synth_config(SynthArch::TinyQwen2), 1, DType::F32);
        let m = EmuModel::new(cfg, &w, GpuDtype::Bf16, [16, 8, 64, 8], true);
        // Nor are the small tiles' entry points (the same bits as the wide ones).
        let e = persistent::encode(&m.plan().body(8), GpuDtype::Bf16, 1).unwrap_err();
        assert!(
            e.contains("op 2 (bgs_gemm_tc_small) is a small-, mid- or large-tile"),
            "{e}"
        );
        // Nor the mid tiles' (a 16-token bucket).
        let m = m.with_tc_mid_max_tokens(plan::TC_MID_TOKENS);
        let e = persistent::encode(&m.plan().body(16), GpuDtype::Bf16, 1).unwrap_err();
        assert!(
            e.contains("op 2 (bgs_gemm_tc_mid) is a small-, mid- or large-tile"),
            "{e}"
        );
        // Nor the large tiles' (a 64-token bucket: QKV on the plain GEMM's).
        let m = m.with_tc_large_min_tokens(plan::TC_LARGE_TOKENS);
        let e = persistent::encode(&m.plan().body(64), GpuDtype::Bf16, 1).unwrap_err();
        assert!(
            e.contains("op 2 (bgs_gemm_tc_large) is a small-, mid- or large-tile"),
            "{e}"
        );
        // Nor the split large tiles' (o_proj and down_proj: one tile, short of two
        // multiprocessors).
        let split = m.with_tc_large_split(8);
        let ops: Vec<Op> = split
            .plan()
            .body(64)
            .into_iter()
            .filter(|op| matches!(op, Op::Launch { kernel, .. } if kernel.is_tc_large_split()))
            .collect();
        assert_eq!(ops.len(), 2 * split.cfg.num_layers);
        let e = persistent::encode(&ops, GpuDtype::Bf16, 1).unwrap_err();
        assert!(
            e.contains("op 0 (bgs_gemm_tc_large_split) is a small-, mid- or large-tile"),
            "{e}"
        );
        let m = split.with_tc_large_split(0);
        let m = m
            .with_tc_large_min_tokens(0)
            .with_tc_mid_max_tokens(0)
            .with_tc_small_max_tokens(0);
        let e = persistent::encode(&m.plan().body(8), GpuDtype::Bf16, 1).unwrap_err();
        assert!(e.contains("(bgs_gemm_tc_silu)"), "{e}");
        let m = m.with_tc_fold_max_tokens(8);
        let e = persistent::encode(&m.plan().body(8), GpuDtype::Bf16, 1).unwrap_err();
        assert!(e.contains("op 2 (bgs_gemm_tc_rope_kv)"), "{e}");
    }

    #[test]
    fn emulator_catches_out_of_bounds_access() {
        let mut e = Emu::new(GpuDtype::F32);
        let p = e.alloc(16, "x").unwrap();
        assert_eq!(e.f32s(p, 4), vec![0.0; 4]);
        let r = std::panic::catch_unwind(|| e.f32s(p, 5));
        assert!(r.is_err());
    }
}
