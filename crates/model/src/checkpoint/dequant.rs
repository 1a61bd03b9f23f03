//! GGML tensor types and their conversion to f32.
//!
//! Block formats (32 elements a block):
//! - `Q8_0`: f16 scale `d`, 32 × i8 `q`; value = `q * d`.
//! - `Q4_0`: f16 `d`, 16 bytes; value = `(nibble - 8) * d`; the low nibbles are elements
//!   0..16 of the block, the high nibbles elements 16..32.
//! - `Q4_1`: f16 `d`, f16 `m`, 16 bytes; value = `nibble * d + m`; same nibble order.

use half::{bf16, f16};

/// Tensor types this loader reads (GGML type ids in brackets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    /// 0
    F32,
    /// 1
    F16,
    /// 2
    Q4_0,
    /// 3
    Q4_1,
    /// 8
    Q8_0,
    /// 30
    BF16,
}

/// Elements per quantization block.
pub const QK: usize = 32;

impl GgmlType {
    /// The type for a GGML id, or `None` for types not supported here.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// The GGML id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q8_0 => 8,
            GgmlType::BF16 => 30,
        }
    }

    /// (elements, bytes) of one block.
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (QK, 18),
            GgmlType::Q4_1 => (QK, 20),
            GgmlType::Q8_0 => (QK, 34),
        }
    }

    /// Bytes for `n` elements, or `None` when `n` is not a whole number of blocks.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        let (be, bb) = self.block();
        n.is_multiple_of(be).then(|| n / be * bb)
    }
}

/// Name of a GGML type id, for error messages.
pub fn ggml_type_name(id: u32) -> String {
    const NAMES: [&str; 31] = [
        "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K",
        "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL",
        "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M", "BF16",
    ];
    match NAMES.get(id as usize) {
        Some(n) => n.to_string(),
        None => format!("type id {id}"),
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Convert `src` (exactly `ty.bytes_for(out.len())` bytes) into `out`.
pub fn dequantize_into(ty: GgmlType, src: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for (v, &q) in o.iter_mut().zip(&b[2..34]) {
                    *v = f32::from(q as i8) * d;
                }
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(18)) {
                let d = f16_at(b, 0);
                let (lo, hi) = o.split_at_mut(QK / 2);
                for (k, &q) in b[2..18].iter().enumerate() {
                    lo[k] = (f32::from(q & 0x0f) - 8.0) * d;
                    hi[k] = (f32::from(q >> 4) - 8.0) * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(20)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                let (lo, hi) = o.split_at_mut(QK / 2);
                for (k, &q) in b[4..20].iter().enumerate() {
                    lo[k] = f32::from(q & 0x0f) * d + m;
                    hi[k] = f32::from(q >> 4) * d + m;
                }
            }
        }
    }
}

/// Convert `n` elements; large tensors are split over the available cores (the split is on
/// block boundaries, so every thread runs the same tight loop).
pub fn dequantize(ty: GgmlType, src: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    let (be, bb) = ty.block();
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    const MIN_PER_THREAD: usize = 1 << 18;
    if threads <= 1 || n < 2 * MIN_PER_THREAD {
        dequantize_into(ty, src, &mut out);
        return out;
    }
    let blocks = n / be;
    let per = blocks.div_ceil(threads);
    std::thread::scope(|s| {
        for (o, b) in out.chunks_mut(per * be).zip(src.chunks(per * bb)) {
            s.spawn(move || dequantize_into(ty, b, o));
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn q8_0_block() {
        let mut b = Vec::new();
        b.extend_from_slice(&h(0.5));
        for k in 0..32i32 {
            b.push((k - 16) as i8 as u8);
        }
        let v = dequantize(GgmlType::Q8_0, &b, 32);
        for (k, x) in v.iter().enumerate() {
            assert_eq!(*x, (k as f32 - 16.0) * 0.5, "element {k}");
        }
    }

    #[test]
    fn q4_0_block_nibble_order() {
        let mut b = Vec::new();
        b.extend_from_slice(&h(2.0));
        // byte k: low nibble = k (element k), high nibble = 15 - k (element 16 + k).
        for k in 0..16u8 {
            b.push(k | ((15 - k) << 4));
        }
        let v = dequantize(GgmlType::Q4_0, &b, 32);
        for k in 0..16 {
            assert_eq!(v[k], (k as f32 - 8.0) * 2.0, "element {k}");
            assert_eq!(
                v[16 + k],
                ((15 - k) as f32 - 8.0) * 2.0,
                "element {}",
                16 + k
            );
        }
        // Hand-computed corners: element 0 = (0-8)*2, element 16 = (15-8)*2.
        assert_eq!(v[0], -16.0);
        assert_eq!(v[16], 14.0);
    }

    #[test]
    fn q4_1_block() {
        let mut b = Vec::new();
        b.extend_from_slice(&h(0.25));
        b.extend_from_slice(&h(-1.0));
        for k in 0..16u8 {
            b.push((k % 16) | (((k + 3) % 16) << 4));
        }
        let v = dequantize(GgmlType::Q4_1, &b, 32);
        for k in 0..16 {
            assert_eq!(v[k], k as f32 * 0.25 - 1.0);
            assert_eq!(v[16 + k], ((k + 3) % 16) as f32 * 0.25 - 1.0);
        }
        assert_eq!(v[31], 2.0 * 0.25 - 1.0);
    }

    #[test]
    fn float_types() {
        let f: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(dequantize(GgmlType::F32, &f, 2), vec![1.5, -2.0]);
        let f: Vec<u8> = [h(0.5), h(-3.0)].concat();
        assert_eq!(dequantize(GgmlType::F16, &f, 2), vec![0.5, -3.0]);
        let f: Vec<u8> = [
            bf16::from_f32(0.75).to_le_bytes(),
            bf16::from_f32(8.0).to_le_bytes(),
        ]
        .concat();
        assert_eq!(dequantize(GgmlType::BF16, &f, 2), vec![0.75, 8.0]);
    }

    #[test]
    fn threaded_split_matches_single_thread() {
        // Enough Q4_1 blocks to take the threaded path.
        let blocks = (1 << 20) / 32;
        let mut src = Vec::with_capacity(blocks * 20);
        let mut x = 1u32;
        for i in 0..blocks {
            src.extend_from_slice(&h((i % 7) as f32 * 0.125));
            src.extend_from_slice(&h(-((i % 5) as f32)));
            for _ in 0..16 {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                src.push((x >> 24) as u8);
            }
        }
        let n = blocks * 32;
        let mut single = vec![0.0; n];
        dequantize_into(GgmlType::Q4_1, &src, &mut single);
        assert_eq!(dequantize(GgmlType::Q4_1, &src, n), single);
    }
}
