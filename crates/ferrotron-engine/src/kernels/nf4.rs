//! NF4, QLoRA's 4-bit NormalFloat (Dettmers et al. 2023), stored as bitsandbytes stores it with
//! `bnb_4bit_quant_type="nf4"` and `bnb_4bit_use_double_quant=True`:
//! - the tensor, flattened row-major, is cut into blocks of 64 values; each block keeps its absolute
//!   maximum `m`, and each value `x` the index of the [`NF4_CODE`] entry nearest to `x / m`, two
//!   indices a byte (the first value in the high nibble);
//! - the absmax constants are themselves quantized ("double quantization"): their mean `offset` is
//!   taken out, and the rest cut into blocks of 256 quantized to 8 bits on bitsandbytes' signed
//!   dynamic code book ([`DYNAMIC_MAP`]) with one f32 scale a block;
//! - a value dequantizes to `NF4_CODE[q] · (DYNAMIC_MAP[qa] · scale + offset)`, every step rounded
//!   to f32 as bitsandbytes' PyTorch path does.
//!
//! A tensor is quantized once, whole (the blocks run over the whole flattened tensor), and then cut:
//! a [`Nf4Matrix`] may be a shard (some rows, or a range of columns, of the whole `[out, in]`
//! matrix) that keeps the codes of its own values and the constants of the blocks it touches, so
//! every layout dequantizes exactly the same values.

use std::ops::Range;

/// Values per quantization block.
pub const BLOCK: usize = 64;
/// Absmax constants per block of the second quantization.
pub const ABSMAX_BLOCK: usize = 256;

/// The 16 NF4 values (QLoRA's normal quantiles, as bitsandbytes tabulates them), as f32 bits:
/// -1, -0.6961928, -0.5250731, -0.3949175, -0.2844414, -0.1847734, -0.0910500, 0, 0.0795803,
/// 0.1609302, 0.2461123, 0.3379152, 0.4407098, 0.5626170, 0.7229568, 1.
const NF4_CODE_BITS: [u32; 16] = [
    0xbf800000, 0xbf3239b1, 0xbf066b30, 0xbeca32a0, 0xbe91a24d, 0xbe3d353f, 0xbdba7871, 0x00000000,
    0x3da2faff, 0x3e24cae3, 0x3e7c04dd, 0x3ead033a, 0x3ee1a4b8, 0x3f1007ab, 0x3f3913b3, 0x3f800000,
];

/// The 16 NF4 values.
pub const NF4_CODE: [f32; 16] = {
    let mut out = [0f32; 16];
    let mut i = 0;
    while i < 16 {
        out[i] = f32::from_bits(NF4_CODE_BITS[i]);
        i += 1;
    }
    out
};

/// bitsandbytes' signed 8-bit dynamic code book (`create_dynamic_map()`), sorted, as f32 bits.
const DYNAMIC_MAP_BITS: [u32; 256] = [
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a, 0xbf650000,
    0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333,
    0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
    0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a,
    0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a,
    0xbedc6666, 0xbed53333, 0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
    0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
    0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334,
    0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
    0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b, 0xbd728f5d, 0xbd670a3d,
    0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3, 0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148,
    0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
    0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4,
    0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
    0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
    0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94, 0xb513a3b7, 0x00000000,
    0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b,
    0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
    0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4,
    0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148,
    0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d,
    0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
    0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
    0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd,
    0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000,
    0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
    0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
    0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666,
    0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666, 0x3f650000,
    0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
];

/// The dynamic code book as f32.
pub fn dynamic_map() -> [f32; 256] {
    DYNAMIC_MAP_BITS.map(f32::from_bits)
}

/// A quantized `[rows, cols]` matrix (`nn.Linear`'s `[out, in]`), whole or a shard of the whole.
#[derive(Clone, PartialEq)]
pub struct Nf4Matrix {
    /// The shard's rows and columns.
    pub rows: usize,
    pub cols: usize,
    /// The whole matrix's columns, and where the shard lies in it: its rows (ranges of the whole
    /// matrix's rows, in order) and its columns.
    whole_cols: usize,
    row_ranges: Vec<Range<usize>>,
    col_start: usize,
    /// The shard's codes, row-major, two a byte, the first in the high nibble.
    codes: Vec<u8>,
    /// The 8-bit absmax codes of blocks `block_start..` of the whole tensor, and the scales of
    /// their groups of [`ABSMAX_BLOCK`] from group `group_start`.
    block_start: usize,
    absmax_q: Vec<u8>,
    group_start: usize,
    absmax_scale: Vec<f32>,
    offset: f32,
}

impl std::fmt::Debug for Nf4Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Nf4Matrix({}×{}, {} bytes)",
            self.rows,
            self.cols,
            self.bytes()
        )
    }
}

/// The nearest code of each value: the number of midpoints between neighbouring codes below it
/// (`torch.bucketize` against the midpoints, as bitsandbytes does).
fn nearest(scaled: f32, code: &[f32]) -> u8 {
    code.windows(2)
        .filter(|w| (w[0] + w[1]) / 2.0 < scaled)
        .count() as u8
}

/// Blockwise absmax quantization of `v` onto `code`, as bitsandbytes' PyTorch path does it: a full
/// block is scaled by the reciprocal of its absmax, the last partial block divided by its absmax
/// (kept at least 1e-38). Returns the codes and the absmax of each block.
fn quantize_blocks(v: &[f32], block: usize, code: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut q = Vec::with_capacity(v.len());
    let mut absmax = Vec::with_capacity(v.len().div_ceil(block));
    for b in v.chunks(block) {
        let m = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        if b.len() == block {
            let inv = 1.0 / m.max(1e-38);
            q.extend(b.iter().map(|&x| nearest((x * inv).clamp(-1.0, 1.0), code)));
            absmax.push(m);
        } else {
            let m = m.max(1e-38);
            q.extend(b.iter().map(|&x| nearest((x / m).clamp(-1.0, 1.0), code)));
            absmax.push(m);
        }
    }
    (q, absmax)
}

/// The f32 lanes of the PyTorch whose sums NF4 quantization reproduces, where set
/// ([`reproduce_torch_lanes`]); 0: the PyTorch this machine runs.
static TORCH_LANES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Makes NF4 quantization in this process reproduce a PyTorch that sums in `lanes` f32 lanes (8: an
/// AVX2 machine or build, 16: AVX-512), whatever this machine would run. The double
/// quantization's offset is a mean, and PyTorch's CPU sum orders its additions by its vector width:
/// a base quantized by bitsandbytes on another machine agrees bit for bit only at that machine's
/// width (`ATEN_CPU_CAPABILITY=avx2` in the environment does the same for a whole run).
pub fn reproduce_torch_lanes(lanes: usize) {
    assert!(
        lanes == 8 || lanes == 16,
        "nf4: PyTorch sums in 8 (AVX2) or 16 (AVX-512) f32 lanes, not {lanes}"
    );
    TORCH_LANES.store(lanes, std::sync::atomic::Ordering::Relaxed);
}

/// Which vector width PyTorch's CPU kernels use here (its `ATEN_CPU_CAPABILITY`): 16 f32 lanes
/// with AVX-512 (F, BW, VL, DQ), 8 otherwise; or the width [`reproduce_torch_lanes`] set.
fn torch_lanes() -> usize {
    match TORCH_LANES.load(std::sync::atomic::Ordering::Relaxed) {
        0 => {}
        lanes => return lanes,
    }
    match std::env::var("ATEN_CPU_CAPABILITY").as_deref() {
        Ok("default") | Ok("avx2") | Ok("AVX2") => return 8,
        _ => {}
    }
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq") {
            return 16;
        }
    }
    8
}

/// `acc[k] += rows(i, k)` over `size` rows in PyTorch's cascade: four levels of partial sums, each
/// level carried into the next every `2^p` rows (`multi_row_sum` of its CPU sum kernel).
fn cascade<const N: usize>(
    size: usize,
    lanes: usize,
    row: impl Fn(usize, usize, usize) -> f32,
) -> [Vec<f32>; N] {
    const LEVELS: usize = 4;
    let ceil_log2 = if size <= 2 {
        1
    } else {
        (usize::BITS - (size - 1).leading_zeros()) as usize
    };
    let power = 4.max(ceil_log2 / LEVELS);
    let (step, mask) = (1usize << power, (1usize << power) - 1);
    let zero = || std::array::from_fn::<Vec<f32>, N, _>(|_| vec![0f32; lanes]);
    let mut acc: [[Vec<f32>; N]; LEVELS] = std::array::from_fn(|_| zero());
    let add_row = |acc: &mut [Vec<f32>; N], i: usize| {
        for (k, a) in acc.iter_mut().enumerate() {
            for (l, v) in a.iter_mut().enumerate() {
                *v += row(i, k, l);
            }
        }
    };
    let mut i = 0;
    while i + step <= size {
        for _ in 0..step {
            add_row(&mut acc[0], i);
            i += 1;
        }
        for j in 1..LEVELS {
            let (lower, upper) = acc.split_at_mut(j);
            for (a, b) in upper[0].iter_mut().zip(lower[j - 1].iter_mut()) {
                a.iter_mut().zip(b.iter_mut()).for_each(|(a, b)| {
                    *a += *b;
                    *b = 0.0;
                });
            }
            if i & (mask << (j * power)) != 0 {
                break;
            }
        }
    }
    while i < size {
        add_row(&mut acc[0], i);
        i += 1;
    }
    let [mut first, rest @ ..] = acc;
    for level in rest {
        for (a, b) in first.iter_mut().zip(level) {
            a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
        }
    }
    first
}

/// The f32 sum of `v` exactly as PyTorch's CPU `sum` computes it on one thread with `lanes`-wide
/// vectors: the vectors of `v` in four interleaved cascades, those added in order, then the tail
/// and the lanes one by one. (A sum of more than 32,768 values is split over PyTorch's threads, so
/// there its result depends on their number; this is the one-thread value.)
fn torch_sum(v: &[f32], lanes: usize) -> f32 {
    const ILP: usize = 4;
    if v.len() < lanes {
        let rows = v.len() / ILP;
        let mut p = cascade::<ILP>(rows, 1, |i, k, _| v[i * ILP + k]);
        for &x in &v[rows * ILP..] {
            p[0][0] += x;
        }
        return (1..ILP).fold(p[0][0], |s, k| s + p[k][0]);
    }
    let vectors = v.len() / lanes;
    let rows = vectors / ILP;
    let mut p = cascade::<ILP>(rows, lanes, |i, k, l| v[(i * ILP + k) * lanes + l]);
    let [first, rest @ ..] = &mut p;
    for i in rows * ILP..vectors {
        first
            .iter_mut()
            .zip(&v[i * lanes..(i + 1) * lanes])
            .for_each(|(a, &x)| *a += x);
    }
    for r in rest.iter() {
        first.iter_mut().zip(r).for_each(|(a, &x)| *a += x);
    }
    let tail = v[vectors * lanes..].iter().fold(0f32, |s, &x| s + x);
    first.iter().fold(tail, |s, &x| s + x)
}

impl Nf4Matrix {
    /// Quantizes the whole `[rows, cols]` matrix `w` (row-major).
    pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Self {
        assert_eq!(
            w.len(),
            rows * cols,
            "nf4: {rows}×{cols} matrix of {} values",
            w.len()
        );
        let (q, absmax) = quantize_blocks(w, BLOCK, &NF4_CODE);
        let codes = q
            .chunks(2)
            .map(|p| (p[0] << 4) | p.get(1).copied().unwrap_or(7))
            .collect();
        // The mean as torch.mean computes it: its f32 sum, divided in f32.
        let offset = torch_sum(&absmax, torch_lanes()) / absmax.len() as f32;
        let centred: Vec<f32> = absmax.iter().map(|&m| m - offset).collect();
        let (absmax_q, absmax_scale) = quantize_blocks(&centred, ABSMAX_BLOCK, &dynamic_map());
        Self {
            rows,
            cols,
            whole_cols: cols,
            row_ranges: std::iter::once(0..rows).collect(),
            col_start: 0,
            codes,
            block_start: 0,
            absmax_q,
            group_start: 0,
            absmax_scale,
            offset,
        }
    }

    /// The absmax of block `b` of the whole tensor, dequantized.
    fn absmax(&self, b: usize) -> f32 {
        let q = self.absmax_q[b - self.block_start];
        let scale = self.absmax_scale[b / ABSMAX_BLOCK - self.group_start];
        f32::from_bits(DYNAMIC_MAP_BITS[q as usize]) * scale + self.offset
    }

    /// The code of the shard's `i`th value (row-major).
    fn code(&self, i: usize) -> usize {
        let byte = self.codes[i / 2];
        (if i.is_multiple_of(2) {
            byte >> 4
        } else {
            byte & 15
        }) as usize
    }

    /// The whole matrix's row of the shard's row `r`.
    fn whole_row(&self, mut r: usize) -> usize {
        for range in &self.row_ranges {
            if r < range.len() {
                return range.start + r;
            }
            r -= range.len();
        }
        panic!("nf4: row {r} past the shard's {} rows", self.rows)
    }

    /// Dequantizes the shard's rows `rows` into `out` (`rows.len() × cols`, row-major).
    pub fn dequantize_rows(&self, rows: Range<usize>, out: &mut [f32]) {
        self.dequantize(rows, 0..self.cols, out)
    }

    /// Dequantizes the block `rows × cols` of the shard into `out` (row-major).
    pub fn dequantize(&self, rows: Range<usize>, cols: Range<usize>, out: &mut [f32]) {
        let width = cols.len();
        assert!(
            cols.end <= self.cols,
            "nf4: columns {cols:?} of {}",
            self.cols
        );
        assert_eq!(
            out.len(),
            rows.len() * width,
            "nf4: output of the block asked"
        );
        if width == 0 {
            return;
        }
        for (r, out) in rows.zip(out.chunks_exact_mut(width)) {
            let start = self.whole_row(r) * self.whole_cols + self.col_start;
            let mut c = cols.start;
            // One absmax per run of values inside one block.
            while c < cols.end {
                let at = start + c;
                let end = cols.end.min(c + BLOCK - at % BLOCK);
                let m = self.absmax(at / BLOCK);
                self.scaled_codes(
                    r * self.cols + c,
                    m,
                    &mut out[c - cols.start..end - cols.start],
                );
                c = end;
            }
        }
    }

    /// `out[j] = NF4_CODE[code(first + j)] · m`, two codes a byte at a time.
    #[inline]
    fn scaled_codes(&self, first: usize, m: f32, out: &mut [f32]) {
        let (mut i, mut j) = (first, 0);
        if i % 2 == 1 && j < out.len() {
            out[j] = NF4_CODE[(self.codes[i / 2] & 15) as usize] * m;
            (i, j) = (i + 1, j + 1);
        }
        let pairs = (out.len() - j) / 2;
        for (o, &b) in out[j..j + 2 * pairs]
            .chunks_exact_mut(2)
            .zip(&self.codes[i / 2..i / 2 + pairs])
        {
            o[0] = NF4_CODE[(b >> 4) as usize] * m;
            o[1] = NF4_CODE[(b & 15) as usize] * m;
        }
        (i, j) = (i + 2 * pairs, j + 2 * pairs);
        if j < out.len() {
            out[j] = NF4_CODE[(self.codes[i / 2] >> 4) as usize] * m;
        }
    }

    /// The whole shard dequantized (tests, exports).
    pub fn dequantized(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        self.dequantize_rows(0..self.rows, &mut out);
        out
    }

    /// The shard that keeps rows `rows` (ranges of this matrix's rows, in order) and columns `cols`.
    pub fn cut(&self, rows: &[Range<usize>], cols: Range<usize>) -> Self {
        assert!(
            cols.end <= self.cols,
            "nf4: columns {cols:?} of {}",
            self.cols
        );
        let row_ranges: Vec<Range<usize>> = rows
            .iter()
            .flat_map(|r| {
                assert!(r.end <= self.rows, "nf4: rows {r:?} of {}", self.rows);
                // This matrix's rows r, as ranges of the whole matrix's rows.
                let mut out = Vec::new();
                let mut i = r.start;
                while i < r.end {
                    let first = self.whole_row(i);
                    let mut n = 1;
                    while i + n < r.end && self.whole_row(i + n) == first + n {
                        n += 1;
                    }
                    out.push(first..first + n);
                    i += n;
                }
                out
            })
            .collect();
        let n_rows: usize = rows.iter().map(Range::len).sum();
        let n_cols = cols.len();
        let mut q = Vec::with_capacity(n_rows * n_cols);
        let mut local = 0;
        for r in rows {
            for row in r.clone() {
                q.extend((cols.clone()).map(|c| self.code(row * self.cols + c) as u8));
                local += 1;
            }
        }
        debug_assert_eq!(local, n_rows);
        let col_start = self.col_start + cols.start;
        // The whole tensor's blocks and absmax groups the shard's values lie in.
        let first = row_ranges
            .first()
            .map(|r| r.start * self.whole_cols + col_start);
        let last = row_ranges
            .last()
            .map(|r| (r.end - 1) * self.whole_cols + col_start + n_cols.max(1) - 1);
        let (blocks, groups) = match (first, last) {
            (Some(f), Some(l)) if n_cols > 0 => (
                f / BLOCK..l / BLOCK + 1,
                f / BLOCK / ABSMAX_BLOCK..l / BLOCK / ABSMAX_BLOCK + 1,
            ),
            _ => (
                self.block_start..self.block_start,
                self.group_start..self.group_start,
            ),
        };
        Self {
            rows: n_rows,
            cols: n_cols,
            whole_cols: self.whole_cols,
            row_ranges,
            col_start,
            codes: q
                .chunks(2)
                .map(|p| (p[0] << 4) | p.get(1).copied().unwrap_or(7))
                .collect(),
            absmax_q: self.absmax_q[blocks.start - self.block_start..blocks.end - self.block_start]
                .to_vec(),
            block_start: blocks.start,
            absmax_scale: self.absmax_scale
                [groups.start - self.group_start..groups.end - self.group_start]
                .to_vec(),
            group_start: groups.start,
            offset: self.offset,
        }
    }

    /// The matrix without its codes (what ZeRO-3 keeps whole: the constants) and the codes.
    pub fn split_codes(mut self) -> (Self, Vec<u8>) {
        let codes = std::mem::take(&mut self.codes);
        (self, codes)
    }

    /// The matrix `shell` (from [`Nf4Matrix::split_codes`]) with its `codes` back.
    pub fn with_codes(shell: &Self, codes: Vec<u8>) -> Self {
        assert_eq!(
            codes.len(),
            (shell.rows * shell.cols).div_ceil(2),
            "nf4: codes of a {}×{} matrix",
            shell.rows,
            shell.cols
        );
        Self {
            codes,
            ..shell.clone()
        }
    }

    /// Bytes held: the codes and the quantization constants.
    pub fn bytes(&self) -> usize {
        self.codes.len() + self.absmax_q.len() + 4 * self.absmax_scale.len() + 4
    }

    /// The quantized storage as bitsandbytes keeps it (whole matrices only): the packed codes, the
    /// 8-bit absmax codes, their scales and the offset.
    pub fn storage(&self) -> (&[u8], &[u8], &[f32], f32) {
        (&self.codes, &self.absmax_q, &self.absmax_scale, self.offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sum_follows_the_cascade_in_every_size_class() {
        // Sums of equal values are exact in any order; the cascade must still visit every value.
        for n in [0, 1, 3, 7, 8, 31, 64, 100, 1000, 5000] {
            for lanes in [8, 16] {
                assert_eq!(
                    torch_sum(&vec![1.0; n], lanes),
                    n as f32,
                    "n {n} lanes {lanes}"
                );
            }
        }
    }

    #[test]
    fn a_cut_dequantizes_the_values_of_the_whole_matrix() {
        let (rows, cols) = (12, 176);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let q = Nf4Matrix::quantize(&w, rows, cols);
        let whole = q.dequantized();
        let rows_cut = q.cut(&[1..3, 7..10], 0..cols);
        let cols_cut = q.cut(&[0..rows, rows..rows], 88..176);
        let both = rows_cut.cut(&[1..4, 4..4], 10..50);
        for (r, wr) in [1, 2, 7, 8, 9].iter().enumerate() {
            assert_eq!(
                rows_cut.dequantized()[r * cols..(r + 1) * cols],
                whole[wr * cols..(wr + 1) * cols]
            );
        }
        for r in 0..rows {
            assert_eq!(
                cols_cut.dequantized()[r * 88..(r + 1) * 88],
                whole[r * cols + 88..(r + 1) * cols]
            );
        }
        for (r, wr) in [2, 7, 8].iter().enumerate() {
            assert_eq!(
                both.dequantized()[r * 40..(r + 1) * 40],
                whole[wr * cols + 10..wr * cols + 50]
            );
        }
        assert!(cols_cut.bytes() < q.bytes() * 6 / 10);
        let priced = ferrotron_core::precision::BaseQuantization::Nf4.matrix_bytes(rows * cols);
        assert_eq!(
            q.bytes(),
            priced,
            "the planner's price is what a matrix holds"
        );
    }
}
