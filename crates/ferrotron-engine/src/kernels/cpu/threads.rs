//! How a kernel spreads its work over a device's cores: the one threading helper every op file
//! shares (rows, pairs of outputs, tasks), and the pointer that lets tasks write disjoint elements.

use crate::kernels::float::Real;
use rayon::prelude::*;

/// The cores one device computes on: 1 keeps every kernel on the calling thread (several devices
/// in one process, each on its own thread), more spreads work over rayon.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Threads {
    threads: usize,
}

impl Threads {
    #[inline]
    pub(crate) fn new(threads: usize) -> Self {
        Self {
            threads: threads.max(1),
        }
    }

    /// How many cores.
    #[inline]
    pub(crate) fn count(&self) -> usize {
        self.threads
    }

    pub(crate) fn parallelism(&self, work: usize) -> gemm::Parallelism {
        // Below ~1 MFLOP the fork/join costs more than it saves.
        if self.threads > 1 && work >= 1 << 20 {
            gemm::Parallelism::Rayon(self.threads)
        } else {
            gemm::Parallelism::None
        }
    }

    /// Runs `f(row_index, out_row)` over the rows of `out`, in parallel when worth it.
    pub(crate) fn for_rows<T: Real, F>(&self, out: &mut [T], width: usize, f: F)
    where
        F: Fn(usize, &mut [T]) + Sync + Send,
    {
        if width == 0 {
            return;
        }
        if self.threads > 1 && out.len() >= 1 << 14 {
            let rows_per_task = (out.len() / width).div_ceil(self.threads * 4).max(1);
            out.par_chunks_mut(rows_per_task * width)
                .enumerate()
                .for_each(|(c, chunk)| {
                    for (i, row) in chunk.chunks_mut(width).enumerate() {
                        f(c * rows_per_task + i, row)
                    }
                });
        } else {
            for (i, row) in out.chunks_mut(width).enumerate() {
                f(i, row)
            }
        }
    }

    /// Runs `f(offset, a_chunk, b_chunk)` over matching chunks of two equally long outputs.
    pub(crate) fn for_pairs<T: Real, F>(&self, a: &mut [T], b: &mut [T], chunk: usize, f: F)
    where
        F: Fn(usize, &mut [T], &mut [T]) + Sync + Send,
    {
        assert_eq!(a.len(), b.len());
        if self.threads > 1 && a.len() >= 4 * chunk {
            a.par_chunks_mut(chunk)
                .zip(b.par_chunks_mut(chunk))
                .enumerate()
                .for_each(|(i, (a, b))| f(i * chunk, a, b));
        } else {
            f(0, a, b)
        }
    }

    /// Runs `f(scratch, task)` for `task in 0..n`, in parallel when `threads > 1`, with a scratch
    /// buffer made by `init` at most once per thread (not once per task), its contents left by the
    /// previous task. The threads take tasks in order as they come free, so a slowed one takes
    /// fewer; and each makes one scratch (rayon's `for_each_init` makes one per piece it splits
    /// off, and attention's scratch is tiles of a megabyte, zeroed anew each time).
    pub(crate) fn for_tasks_with<S, I, F>(&self, n: usize, init: I, f: F)
    where
        I: Fn() -> S + Sync + Send,
        F: Fn(&mut S, usize) + Sync + Send,
    {
        if self.threads > 1 && n > 1 {
            use std::sync::atomic::{AtomicUsize, Ordering};
            let next = AtomicUsize::new(0);
            (0..self.threads.min(n)).into_par_iter().for_each(|_| {
                // Made with the first task this worker takes: none where the others took all.
                let mut scratch = None;
                loop {
                    let task = next.fetch_add(1, Ordering::Relaxed);
                    if task >= n {
                        break;
                    }
                    f(scratch.get_or_insert_with(&init), task)
                }
            })
        } else {
            let mut scratch = init();
            (0..n).for_each(|task| f(&mut scratch, task))
        }
    }

    /// Runs `f(task)` for `task in 0..n`, in parallel when `threads > 1`.
    #[cfg(test)]
    pub(crate) fn for_tasks<F>(&self, n: usize, f: F)
    where
        F: Fn(usize) + Sync + Send,
    {
        if self.threads > 1 && n > 1 {
            (0..n).into_par_iter().for_each(f)
        } else {
            (0..n).for_each(f)
        }
    }
}

/// A raw pointer that may cross threads; used only where tasks write provably disjoint elements.
pub(crate) struct SendPtr<T>(pub *mut T);
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// Through a method, so closures capture the whole `SendPtr` (not its raw-pointer field).
    pub fn get(self) -> *mut T {
        self.0
    }
}
