//! RMSNorm (Llama) and LayerNorm (GPT-2): forward, input gradient, weight gradient.

use super::CpuBackend;

impl CpuBackend {
    pub(crate) fn rmsnorm_forward_impl(
        &self,
        x: &[f32],
        w: &[f32],
        eps: f32,
        y: &mut [f32],
        rstd: &mut [f32],
    ) {
        let n = w.len();
        for (r, xr) in rstd.iter_mut().zip(x.chunks_exact(n)) {
            let ms = xr.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / n as f64;
            *r = (1.0 / (ms + eps as f64).sqrt()) as f32;
        }
        let rstd: &[f32] = rstd;
        self.for_rows(y, n, |i, yr| {
            let (xr, r) = (&x[i * n..(i + 1) * n], rstd[i]);
            for ((y, &x), &w) in yr.iter_mut().zip(xr).zip(w) {
                *y = w * (x * r);
            }
        });
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rmsnorm_backward_input_impl(
        &self,
        dy: &[f32],
        x: &[f32],
        w: &[f32],
        rstd: &[f32],
        dx: &mut [f32],
        acc: bool,
    ) {
        let n = w.len();
        self.for_rows(dx, n, |i, dxr| {
            let (xr, dyr, r) = (&x[i * n..(i + 1) * n], &dy[i * n..(i + 1) * n], rstd[i]);
            let dot: f64 = dyr
                .iter()
                .zip(w)
                .zip(xr)
                .map(|((&g, &w), &x)| (g * w) as f64 * x as f64)
                .sum();
            let c = (dot / n as f64) as f32 * r * r * r;
            for (((d, &g), &w), &x) in dxr.iter_mut().zip(dyr).zip(w).zip(xr) {
                let v = r * g * w - c * x;
                *d = if acc { *d + v } else { v };
            }
        });
    }

    pub(crate) fn rmsnorm_backward_weight_impl(
        &self,
        dy: &[f32],
        x: &[f32],
        rstd: &[f32],
        dw: &mut [f32],
    ) {
        let n = dw.len();
        let mut acc = vec![0f64; n];
        for ((dyr, xr), &r) in dy.chunks_exact(n).zip(x.chunks_exact(n)).zip(rstd) {
            for ((a, &g), &x) in acc.iter_mut().zip(dyr).zip(xr) {
                *a += (g * x * r) as f64;
            }
        }
        dw.iter_mut().zip(acc).for_each(|(d, a)| *d += a as f32);
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layernorm_forward_impl(
        &self,
        x: &[f32],
        w: &[f32],
        b: &[f32],
        eps: f32,
        y: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
    ) {
        let n = w.len();
        for ((m, r), xr) in mean.iter_mut().zip(rstd.iter_mut()).zip(x.chunks_exact(n)) {
            let mu = xr.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
            let var = xr.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / n as f64;
            *m = mu as f32;
            *r = (1.0 / (var + eps as f64).sqrt()) as f32;
        }
        let (mean, rstd): (&[f32], &[f32]) = (mean, rstd);
        self.for_rows(y, n, |i, yr| {
            let (xr, m, r) = (&x[i * n..(i + 1) * n], mean[i], rstd[i]);
            for (((y, &x), &w), &b) in yr.iter_mut().zip(xr).zip(w).zip(b) {
                *y = (x - m) * r * w + b;
            }
        });
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layernorm_backward_input_impl(
        &self,
        dy: &[f32],
        x: &[f32],
        w: &[f32],
        mean: &[f32],
        rstd: &[f32],
        dx: &mut [f32],
        acc: bool,
    ) {
        let n = w.len();
        self.for_rows(dx, n, |i, dxr| {
            let (xr, dyr, m, r) = (
                &x[i * n..(i + 1) * n],
                &dy[i * n..(i + 1) * n],
                mean[i],
                rstd[i],
            );
            let (mut sg, mut sgx) = (0f64, 0f64);
            for ((&g, &w), &x) in dyr.iter().zip(w).zip(xr) {
                let gw = (g * w) as f64;
                sg += gw;
                sgx += gw * ((x - m) * r) as f64;
            }
            let (mg, mgx) = ((sg / n as f64) as f32, (sgx / n as f64) as f32);
            for (((d, &g), &w), &x) in dxr.iter_mut().zip(dyr).zip(w).zip(xr) {
                let v = r * (g * w - mg - (x - m) * r * mgx);
                *d = if acc { *d + v } else { v };
            }
        });
    }

    pub(crate) fn layernorm_backward_weight_impl(
        &self,
        dy: &[f32],
        x: &[f32],
        mean: &[f32],
        rstd: &[f32],
        dw: &mut [f32],
        db: &mut [f32],
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
                *aw += (g * (x - m) * r) as f64;
                *ab += g as f64;
            }
        }
        dw.iter_mut().zip(aw).for_each(|(d, a)| *d += a as f32);
        db.iter_mut().zip(ab).for_each(|(d, a)| *d += a as f32);
    }
}
