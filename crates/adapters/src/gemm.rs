//! 8x8 single-precision matrix product.

/// `c = a · b` for row-major 8x8 matrices, accumulating in f32 in a fixed order
/// (k ascending) so results are bit-reproducible.
#[inline]
pub fn gemm8(a: &[f32; 64], b: &[f32; 64], c: &mut [f32; 64]) {
    for i in 0..8 {
        let mut row = [0f32; 8];
        for k in 0..8 {
            let aik = a[i * 8 + k];
            for j in 0..8 {
                row[j] = aik.mul_add(b[k * 8 + j], row[j]);
            }
        }
        c[i * 8..i * 8 + 8].copy_from_slice(&row);
    }
}
