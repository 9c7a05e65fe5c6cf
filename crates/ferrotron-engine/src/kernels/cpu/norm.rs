//! RMSNorm (Llama) and LayerNorm (GPT-2): forward, input gradient, weight gradient.

use super::threads::SendPtr;
use super::threads::Threads;
use crate::kernels::float::Real;
use crate::kernels::simd::{self, simd_kernel};

simd_kernel! {
    pub(crate) fn rms_forward<T: Real>(
        threads: &Threads,
        x: &[T],
        w: &[T],
        eps: T,
        y: &mut [T],
        rstd: &mut [T],
    ) {
        let n = w.len();
        assert_eq!(rstd.len() * n, y.len(), "rmsnorm: rstd length");
        // Each row's statistic in the same task as its output (a pass on the calling thread
        // first would leave the other cores waiting).
        let rstd_p = SendPtr(rstd.as_mut_ptr());
        threads.for_rows(y, n, |i, yr| {
            let xr = &x[i * n..(i + 1) * n];
            let ms = simd::sum_sq_f64(xr) / n as f64;
            let r = T::of(1.0 / (ms + eps.to_f64()).sqrt());
            // SAFETY: row i's task alone writes rstd[i], inside it (checked above).
            unsafe { *rstd_p.get().add(i) = r };
            for ((y, &x), &w) in yr.iter_mut().zip(xr).zip(w) {
                *y = w * (x * r);
            }
        });
    }
}

simd_kernel! {
    pub(crate) fn rms_backward_input<T: Real>(
        threads: &Threads,
        dy: &[T],
        x: &[T],
        w: &[T],
        rstd: &[T],
        dx: &mut [T],
        acc: bool,
    ) {
        let n = w.len();
        threads.for_rows(dx, n, |i, dxr| {
            let (xr, dyr, r) = (&x[i * n..(i + 1) * n], &dy[i * n..(i + 1) * n], rstd[i]);
            let dot = simd::dot3_f64(dyr, w, xr);
            let c = T::of(dot / n as f64) * r * r * r;
            for (((d, &g), &w), &x) in dxr.iter_mut().zip(dyr).zip(w).zip(xr) {
                let v = r * g * w - c * x;
                *d = if acc { *d + v } else { v };
            }
        });
    }
}

simd_kernel! {
    pub(crate) fn rms_backward_weight<T: Real>(dy: &[T], x: &[T], rstd: &[T], dw: &mut [T]) {
        let n = dw.len();
        let mut acc = vec![0f64; n];
        for ((dyr, xr), &r) in dy.chunks_exact(n).zip(x.chunks_exact(n)).zip(rstd) {
            for ((a, &g), &x) in acc.iter_mut().zip(dyr).zip(xr) {
                *a += (g * x * r).to_f64();
            }
        }
        dw.iter_mut().zip(acc).for_each(|(d, a)| *d += T::of(a));
    }
}

simd_kernel! {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer_forward<T: Real>(
        threads: &Threads,
        x: &[T],
        w: &[T],
        b: &[T],
        eps: T,
        y: &mut [T],
        mean: &mut [T],
        rstd: &mut [T],
    ) {
        let n = w.len();
        for ((m, r), xr) in mean.iter_mut().zip(rstd.iter_mut()).zip(x.chunks_exact(n)) {
            let mu = xr.iter().map(|&v| v.to_f64()).sum::<f64>() / n as f64;
            let var = xr.iter().map(|&v| (v.to_f64() - mu).powi(2)).sum::<f64>() / n as f64;
            *m = T::of(mu);
            *r = T::of(1.0 / (var + eps.to_f64()).sqrt());
        }
        let (mean, rstd): (&[T], &[T]) = (mean, rstd);
        threads.for_rows(y, n, |i, yr| {
            let (xr, m, r) = (&x[i * n..(i + 1) * n], mean[i], rstd[i]);
            for (((y, &x), &w), &b) in yr.iter_mut().zip(xr).zip(w).zip(b) {
                *y = (x - m) * r * w + b;
            }
        });
    }
}

simd_kernel! {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer_backward_input<T: Real>(
        threads: &Threads,
        dy: &[T],
        x: &[T],
        w: &[T],
        mean: &[T],
        rstd: &[T],
        dx: &mut [T],
        acc: bool,
    ) {
        let n = w.len();
        threads.for_rows(dx, n, |i, dxr| {
            let (xr, dyr, m, r) = (
                &x[i * n..(i + 1) * n],
                &dy[i * n..(i + 1) * n],
                mean[i],
                rstd[i],
            );
            let (mut sg, mut sgx) = (0f64, 0f64);
            for ((&g, &w), &x) in dyr.iter().zip(w).zip(xr) {
                let gw = (g * w).to_f64();
                sg += gw;
                sgx += gw * ((x - m) * r).to_f64();
            }
            let (mg, mgx) = (T::of(sg / n as f64), T::of(sgx / n as f64));
            for (((d, &g), &w), &x) in dxr.iter_mut().zip(dyr).zip(w).zip(xr) {
                let v = r * (g * w - mg - (x - m) * r * mgx);
                *d = if acc { *d + v } else { v };
            }
        });
    }
}

simd_kernel! {
    pub(crate) fn layer_backward_weight<T: Real>(
        dy: &[T],
        x: &[T],
        mean: &[T],
        rstd: &[T],
        dw: &mut [T],
        db: &mut [T],
    ) {
        let n = dw.len();
        let (mut aw, mut ab) = (vec![0f64; n], vec![0f64; n]);
        for (((dyr, xr), &m), &r) in dy
            .chunks_exact(n)
            .zip(x.chunks_exact(n))
            .zip(mean)
            .zip(rstd)
        {
            for (((aw, ab), &g), &x) in aw.iter_mut().zip(ab.iter_mut()).zip(dyr).zip(xr) {
                *aw += (g * (x - m) * r).to_f64();
                *ab += g.to_f64();
            }
        }
        dw.iter_mut().zip(aw).for_each(|(d, a)| *d += T::of(a));
        db.iter_mut().zip(ab).for_each(|(d, a)| *d += T::of(a));
    }
}
