//! Memory measured, not summed: a global allocator that attributes every live allocation to the
//! device whose thread made it and to the term the code was in (weights, gradients, …), so the peak
//! per device per term is a measurement. The runtime reports it in the planner's terms, so
//! measurement and prediction line up.
//!
//! Each allocation carries a small header with its device and term, so freeing (on any thread) is
//! charged back to where it was counted. A device thread declares itself with [`set_device`]; code
//! declares what it allocates for with [`scope`]. Allocations outside a device are not counted.

pub use ferrotron_core::plan::MemoryTerms;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};

/// What an allocation is for: the planner's six terms, and everything else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Term {
    Weights = 0,
    Gradients = 1,
    MasterWeights = 2,
    OptimizerStates = 3,
    Activations = 4,
    CommBuffers = 5,
    Other = 6,
}

const TERMS: usize = 7;
/// Devices one process can account for (threads backend: one per device thread).
pub const MAX_DEVICES: usize = 64;
const NO_DEVICE: u16 = u16::MAX;

thread_local! {
    /// (device, term) of this thread's allocations.
    static CURRENT: Cell<(u16, u8)> = const { Cell::new((NO_DEVICE, Term::Other as u8)) };
}

/// One device's counters, on cache lines of their own: device threads allocate all the time, and
/// sharing a line between two devices' counters would charge each for the other's traffic.
#[repr(align(128))]
struct Counters {
    live: [AtomicI64; TERMS],
    peak: [AtomicI64; TERMS],
    live_total: AtomicI64,
    peak_total: AtomicI64,
    /// The live bytes per term when the total last reached a new peak: what the peak was made of.
    at_peak: [AtomicI64; TERMS],
    capacity: AtomicU64,
    /// Set when the device first went over its capacity, with the live bytes per term then.
    oom: AtomicI64,
    oom_at: [AtomicI64; TERMS],
}

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicI64 = AtomicI64::new(0);
#[allow(clippy::declare_interior_mutable_const)]
const FRESH: Counters = Counters {
    live: [ZERO; TERMS],
    peak: [ZERO; TERMS],
    live_total: ZERO,
    peak_total: ZERO,
    at_peak: [ZERO; TERMS],
    capacity: AtomicU64::new(u64::MAX),
    oom: ZERO,
    oom_at: [ZERO; TERMS],
};
static DEVICES: [Counters; MAX_DEVICES] = [FRESH; MAX_DEVICES];

/// The allocator: the system's, plus a header per allocation and the counters.
pub struct TrackingAllocator;

/// Allocations of at least this many bytes start on a cache line: the kernels' vector and tile loads
/// and stores of a buffer that straddles lines touch two lines each (the AMX GEMM ran 20% slower on
/// such an output).
const LINE_ALIGNED_FROM: usize = 4096;

/// A device's allocations of at least this many bytes (activations, weights, gradients: tensors)
/// are blocks on huge pages where Linux has them (transparent huge pages, asked for per block): the
/// kernels read a head or a column of such a tensor a row stride apart, a 4 KiB page every row or
/// two, and on 4 KiB pages attention's eight tensors of 2048 tokens span more pages than the TLB
/// holds (measured on `bench attention`, bf16, 2048 tokens: 4–5% faster, faster in 15 of 16
/// alternated runs). `FERROTRON_HUGE_PAGES=0` turns this off.
const HUGE_FROM: usize = HUGE_PAGE;

/// The size (and alignment) of an x86-64 or AArch64 Linux huge page.
const HUGE_PAGE: usize = 2 << 20;

/// Whether an allocation of `size` bytes made for `device` goes on huge pages: a device's tensors
/// only. Not what no device owns — the link's messages and the backends' helper threads' buffers,
/// copied through once front to back (no TLB to spare), whose times are the link's: faulting in
/// whole huge pages as each message was made left the threads backend's overlap of transfers with
/// compute erratic (a started all-gather's margin over the blocking one 0.056–0.257 s in eight
/// runs, 0.099–0.103 s with devices' blocks alone on huge pages).
fn huge(size: usize, device: u16) -> bool {
    size >= HUGE_FROM && (device as usize) < MAX_DEVICES && huge_pages_wanted()
}

/// Whether huge pages are on ([`HUGE_FROM`]): unless `FERROTRON_HUGE_PAGES` is `0`, on Linux. Read
/// once, without allocating (this runs inside the allocator).
fn huge_pages_wanted() -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::sync::atomic::AtomicU8;
        // 0: not read yet; 1: on; 2: off.
        static WANTED: AtomicU8 = AtomicU8::new(0);
        match WANTED.load(Relaxed) {
            1 => true,
            2 => false,
            _ => {
                // SAFETY: a NUL-terminated name; the value is read before anything could change it
                // (the environment is set before threads start).
                let off = unsafe {
                    let v = libc::getenv(c"FERROTRON_HUGE_PAGES".as_ptr());
                    !v.is_null() && std::ffi::CStr::from_ptr(v).to_bytes() == b"0"
                };
                WANTED.store(if off { 2 } else { 1 }, Relaxed);
                !off
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    false
}

/// `FERROTRON_HUGE_PAGES` as given, checked (the allocator cannot say what it does not understand,
/// and reads anything but `0` as on): unset, `0` or `1`, or an error naming the value and the two
/// it takes. The CLI checks it before it runs anything.
pub fn check_huge_pages_setting() -> Result<(), String> {
    match std::env::var("FERROTRON_HUGE_PAGES") {
        Err(std::env::VarError::NotPresent) => Ok(()),
        Ok(v) if v == "0" || v == "1" => Ok(()),
        Ok(v) => Err(format!(
            "FERROTRON_HUGE_PAGES={v}: give 0 (small pages) or 1 (huge pages for a device's \
             tensors, the default)"
        )),
        Err(std::env::VarError::NotUnicode(v)) => Err(format!(
            "FERROTRON_HUGE_PAGES={v:?}: give 0 (small pages) or 1 (huge pages for a device's \
             tensors, the default)"
        )),
    }
}

/// The alignment of the block behind an allocation of `layout` for `device`: its header's, or a
/// huge page's.
fn block_align(layout: Layout, device: u16) -> usize {
    if huge(layout.size(), device) {
        header(layout).max(HUGE_PAGE)
    } else {
        header(layout)
    }
}

/// Bytes in front of every allocation: its device and term, at an offset that keeps the alignment.
fn header(layout: Layout) -> usize {
    if layout.size() >= LINE_ALIGNED_FROM {
        layout.align().max(64)
    } else {
        layout.align().max(16)
    }
}

/// Asks for huge pages behind the block at `base` (`len` bytes, from a huge page's boundary) before
/// any of it is touched: the pages are made on first touch, so a block already touched would keep
/// its small ones.
#[cfg(target_os = "linux")]
unsafe fn ask_huge_pages(base: *mut u8, len: usize) {
    // Advice: where the kernel has no huge page to give, the block gets small ones, as before.
    libc::madvise(
        base.cast(),
        len / HUGE_PAGE * HUGE_PAGE,
        libc::MADV_HUGEPAGE,
    );
}
#[cfg(not(target_os = "linux"))]
unsafe fn ask_huge_pages(_: *mut u8, _: usize) {}

fn charge(device: u16, term: u8, bytes: i64) {
    let Some(c) = DEVICES.get(device as usize) else {
        return;
    };
    let t = term as usize;
    let now = c.live[t].fetch_add(bytes, Relaxed) + bytes;
    let total = c.live_total.fetch_add(bytes, Relaxed) + bytes;
    if bytes > 0 {
        c.peak[t].fetch_max(now, Relaxed);
        if c.peak_total.fetch_max(total, Relaxed) < total {
            for (at, live) in c.at_peak.iter().zip(&c.live) {
                at.store(live.load(Relaxed), Relaxed);
            }
        }
        if total as u64 > c.capacity.load(Relaxed) && c.oom.swap(1, Relaxed) == 0 {
            for (at, live) in c.oom_at.iter().zip(&c.live) {
                at.store(live.load(Relaxed), Relaxed);
            }
        }
    }
}

impl TrackingAllocator {
    /// Allocates with the header in front; `zeroed` as the system zeroes (calloc's lazily zeroed
    /// pages for small blocks; line-aligned blocks are written with zeros, as the standard library
    /// does for any alignment above 16).
    unsafe fn allocate(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        let (device, term) = CURRENT.try_with(Cell::get).unwrap_or((NO_DEVICE, 0));
        self.allocate_for(layout, zeroed, device, term)
    }

    /// [`TrackingAllocator::allocate`] charged to `device` and `term`.
    unsafe fn allocate_for(&self, layout: Layout, zeroed: bool, device: u16, term: u8) -> *mut u8 {
        let h = header(layout);
        let Ok(full) = Layout::from_size_align(layout.size() + h, block_align(layout, device))
        else {
            return std::ptr::null_mut();
        };
        let huge = huge(layout.size(), device);
        // A block on huge pages is zeroed after the advice, so that zeroing makes huge pages.
        let base = if zeroed && !huge {
            System.alloc_zeroed(full)
        } else {
            System.alloc(full)
        };
        if base.is_null() {
            return base;
        }
        if huge {
            ask_huge_pages(base, full.size());
            if zeroed {
                std::ptr::write_bytes(base, 0, full.size());
            }
        }
        let p = base.add(h);
        (p.sub(4) as *mut u16).write_unaligned(device);
        p.sub(2).write(term);
        charge(device, term, layout.size() as i64);
        p
    }
}

// SAFETY: every allocation is the system's with a header in front; the header records what the
// accounting needs and is never handed out.
unsafe impl GlobalAlloc for TrackingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.allocate(layout, false)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.allocate(layout, true)
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        let h = header(layout);
        let device = (p.sub(4) as *const u16).read_unaligned();
        let term = p.sub(2).read();
        charge(device, term, -(layout.size() as i64));
        let full =
            Layout::from_size_align_unchecked(layout.size() + h, block_align(layout, device));
        System.dealloc(p.sub(h), full)
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let h = header(layout);
        let device = (p.sub(4) as *const u16).read_unaligned();
        let term = p.sub(2).read();
        let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
        if block_align(new_layout, device) != block_align(layout, device) || huge(new_size, device)
        {
            // Across the line-alignment threshold the block's alignment (and the header) change,
            // and a block on huge pages is advised before it is touched: a new block, keeping the
            // device and term.
            let q = self.allocate_for(new_layout, false, device, term);
            if !q.is_null() {
                std::ptr::copy_nonoverlapping(p, q, layout.size().min(new_size));
                self.dealloc(p, layout);
            }
            return q;
        }
        let full =
            Layout::from_size_align_unchecked(layout.size() + h, block_align(layout, device));
        let base = System.realloc(p.sub(h), full, new_size + h);
        if base.is_null() {
            return base;
        }
        // The header moved with the block: the allocation keeps its device and term.
        charge(device, term, new_size as i64 - layout.size() as i64);
        base.add(h)
    }
}

#[global_allocator]
static GLOBAL: TrackingAllocator = TrackingAllocator;

/// While the guard lives, this thread's allocations count on no device: the threads backend's
/// message buffers, which stand for the bytes on a wire or in a switch and for the transport's
/// buffers, no device's memory. (Counted on the sender until its receiver took them, messages made
/// a device's peak depend on how far in wall time its thread ran ahead of its receiver's on a
/// machine with fewer cores than devices: a queue devices in step never build; and the pool of
/// idle ones on the receiver grew with it. A GPU's collective library stages through fixed buffers
/// of its own, reserved once, outside the planner's terms as the runtime's context is.)
pub fn on_the_link() -> LinkGuard {
    LinkGuard(CURRENT.with(|c| c.replace((NO_DEVICE, Term::Other as u8))))
}

/// Restores the thread's device and term when dropped.
pub struct LinkGuard((u16, u8));

impl Drop for LinkGuard {
    fn drop(&mut self) {
        let before = self.0;
        CURRENT.with(|c| c.set(before));
    }
}

/// Counts this thread's allocations to `device` from now on (a device thread calls it first).
pub fn set_device(device: usize) {
    let d = if device < MAX_DEVICES {
        device as u16
    } else {
        NO_DEVICE
    };
    CURRENT.with(|c| c.set((d, c.get().1)));
}

/// Stops counting this thread's allocations.
pub fn clear_device() {
    CURRENT.with(|c| c.set((NO_DEVICE, Term::Other as u8)));
}

/// While the guard lives, this thread's allocations count as `term`.
pub fn scope(term: Term) -> TermGuard {
    let before = CURRENT.with(|c| {
        let old = c.get();
        c.set((old.0, term as u8));
        old.1
    });
    TermGuard(before)
}

/// Restores the previous term when dropped.
pub struct TermGuard(u8);

impl Drop for TermGuard {
    fn drop(&mut self) {
        let t = self.0;
        CURRENT.with(|c| c.set((c.get().0, t)));
    }
}

/// Live and peak bytes of one device, by term.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeviceMemory {
    pub live: [u64; TERMS],
    pub peak: [u64; TERMS],
    /// The highest total at any moment (not the sum of the terms' peaks).
    pub peak_total: u64,
    /// What the device held by term at that moment (these add up to about `peak_total`: another
    /// thread of the device may allocate while they are read).
    pub at_peak: [u64; TERMS],
}

fn terms_of(v: &[u64; TERMS]) -> MemoryTerms {
    MemoryTerms {
        weights: v[0],
        gradients: v[1],
        master_weights: v[2],
        optimizer_states: v[3],
        activations: v[4],
        comm_buffers: v[5],
        total: 0,
    }
    .with_total()
}

impl DeviceMemory {
    /// What the peak total was made of, in the planner's terms (`total` is the highest total;
    /// everything else the device held then is the remainder).
    pub fn terms_at_peak(&self) -> MemoryTerms {
        MemoryTerms {
            total: self.peak_total,
            ..terms_of(&self.at_peak)
        }
    }

    /// Peak per term, in the planner's terms (`total` is the highest total at any moment; `other`
    /// is reported separately).
    pub fn peak_terms(&self) -> MemoryTerms {
        MemoryTerms {
            total: self.peak_total,
            ..terms_of(&self.peak)
        }
    }
    pub fn peak_other(&self) -> u64 {
        self.peak[6]
    }
    /// What of the peak total was the kernels' workspace (`other`), held at that moment: the part
    /// of the total no plan counts (its own peak may come at another moment and be larger).
    pub fn other_at_peak(&self) -> u64 {
        self.at_peak[6]
    }
}

/// What device `device` holds now and has held at most since the last [`reset_peaks`].
pub fn device_memory(device: usize) -> DeviceMemory {
    let mut m = DeviceMemory::default();
    if device >= MAX_DEVICES {
        return m;
    }
    let c = &DEVICES[device];
    for t in 0..TERMS {
        m.live[t] = c.live[t].load(Relaxed).max(0) as u64;
        m.peak[t] = c.peak[t].load(Relaxed).max(0) as u64;
        m.at_peak[t] = c.at_peak[t].load(Relaxed).max(0) as u64;
    }
    m.peak_total = c.peak_total.load(Relaxed).max(0) as u64;
    m
}

/// One reading of a device's memory during a step: when (device time), what it held, and the most
/// it had held at any moment since its peaks were last reset (so the interval in which the peak
/// fell is the one where `peak_bytes` last rose).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct MemorySample {
    pub time_s: f64,
    pub live_bytes: u64,
    pub peak_bytes: u64,
}

/// What `device` holds now, every term together, stamped with `time_s`.
pub fn sample(device: usize, time_s: f64) -> MemorySample {
    let Some(c) = DEVICES.get(device) else {
        return MemorySample {
            time_s,
            ..MemorySample::default()
        };
    };
    MemorySample {
        time_s,
        live_bytes: c.live_total.load(Relaxed).max(0) as u64,
        peak_bytes: c.peak_total.load(Relaxed).max(0) as u64,
    }
}

/// Starts measuring peaks afresh on `device` (from what it holds now).
pub fn reset_peaks(device: usize) {
    if device >= MAX_DEVICES {
        return;
    }
    let c = &DEVICES[device];
    for t in 0..TERMS {
        c.peak[t].store(c.live[t].load(Relaxed), Relaxed);
        c.at_peak[t].store(c.live[t].load(Relaxed), Relaxed);
    }
    c.peak_total.store(c.live_total.load(Relaxed), Relaxed);
}

/// Gives `device` a capacity in bytes (`None`: unlimited) and clears any earlier overflow.
pub fn set_capacity(device: usize, bytes: Option<u64>) {
    if device < MAX_DEVICES {
        let c = &DEVICES[device];
        c.capacity.store(bytes.unwrap_or(u64::MAX), Relaxed);
        c.oom.store(0, Relaxed);
    }
}

/// If `device` has gone over its capacity: the live bytes per term at that moment (the planner's
/// six, whose `total` then includes everything else the device held).
pub fn over_capacity(device: usize) -> Option<MemoryTerms> {
    if device >= MAX_DEVICES || DEVICES[device].oom.load(Relaxed) == 0 {
        return None;
    }
    let mut v = [0u64; TERMS];
    for (x, at) in v.iter_mut().zip(&DEVICES[device].oom_at) {
        *x = at.load(Relaxed).max(0) as u64;
    }
    Some(MemoryTerms {
        total: v.iter().sum(),
        ..terms_of(&v)
    })
}

/// The capacity given to `device`, if any.
pub fn capacity(device: usize) -> Option<u64> {
    (device < MAX_DEVICES)
        .then(|| DEVICES[device].capacity.load(Relaxed))
        .filter(|&c| c != u64::MAX)
}

/// Accounts in use by meshes running in this process (bit d: account d).
static CLAIMED: std::sync::Mutex<u64> = std::sync::Mutex::new(0);

/// `n` consecutive accounts for one mesh's devices, free again when dropped, so that meshes
/// running at the same time in one process (tests) never share an account.
pub struct Accounts {
    pub base: usize,
    n: usize,
}

impl Accounts {
    /// Waits until `n` consecutive accounts are free and claims them (their counters start at zero
    /// live bytes). More than [`MAX_DEVICES`] devices: none are claimed (`base` is past the end and
    /// nothing is counted).
    pub fn claim(n: usize) -> Self {
        if n == 0 || n > MAX_DEVICES {
            return Self {
                base: MAX_DEVICES,
                n: 0,
            };
        }
        let mask = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
        loop {
            {
                let mut claimed = CLAIMED.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(base) = (0..=MAX_DEVICES - n).find(|b| *claimed & (mask << b) == 0) {
                    *claimed |= mask << base;
                    for d in base..base + n {
                        reset_peaks(d);
                        set_capacity(d, None);
                    }
                    return Self { base, n };
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}

impl Drop for Accounts {
    fn drop(&mut self) {
        if self.n > 0 {
            let mask = if self.n == 64 {
                u64::MAX
            } else {
                (1u64 << self.n) - 1
            };
            *CLAIMED.lock().unwrap_or_else(|e| e.into_inner()) &= !(mask << self.base);
        }
    }
}

/// Bytes for people: `1.23 MB`.
pub fn format_bytes(b: u64) -> String {
    let b = b as f64;
    match [("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)]
        .into_iter()
        .find(|&(_, d)| b >= d)
    {
        Some((unit, d)) => format!("{:.2} {unit}", b / d),
        None => format!("{b} B"),
    }
}

/// One line per term.
pub fn format_terms(t: &MemoryTerms) -> String {
    [
        ("weights", t.weights),
        ("gradients", t.gradients),
        ("master_weights", t.master_weights),
        ("optimizer_states", t.optimizer_states),
        ("activations", t.activations),
        ("comm_buffers", t.comm_buffers),
        (
            "other",
            t.total.saturating_sub(
                t.weights
                    + t.gradients
                    + t.master_weights
                    + t.optimizer_states
                    + t.activations
                    + t.comm_buffers,
            ),
        ),
        ("total", t.total),
    ]
    .iter()
    .map(|(n, v)| format!("  {n:<17} {:>12}", format_bytes(*v)))
    .collect::<Vec<_>>()
    .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_counted_to_their_device_and_term_and_freed_back() {
        // A device number no other test uses.
        let d = MAX_DEVICES - 1;
        std::thread::spawn(move || {
            set_device(d);
            reset_peaks(d);
            let before = device_memory(d);
            let w = {
                let _g = scope(Term::Weights);
                vec![0u8; 1 << 20]
            };
            let mut a = {
                let _g = scope(Term::Activations);
                Vec::<u32>::with_capacity(10)
            };
            a.extend(0..100_000); // grows by realloc: still activations
            let m = device_memory(d);
            assert_eq!(m.live[0] - before.live[0], 1 << 20);
            assert!(m.live[4] - before.live[4] >= 400_000);
            // What is allocated on the link counts on no device, and freeing it changes nothing.
            let before_link = device_memory(d);
            let on_link = {
                let _link = on_the_link();
                vec![0u64; 1000]
            };
            assert_eq!(device_memory(d).live, before_link.live);
            drop(on_link);
            assert_eq!(device_memory(d).live, before_link.live);
            drop(w);
            drop(a);
            let after = device_memory(d);
            assert_eq!(after.live, before.live);
            assert!(after.peak[0] >= 1 << 20);
            set_capacity(d, Some(after.live.iter().sum::<u64>() + 1000));
            let big = {
                let _g = scope(Term::Gradients);
                vec![0u8; 5000]
            };
            let oom = over_capacity(d).expect("over capacity");
            assert!(oom.gradients >= 5000, "{oom:?}");
            drop(big);
            set_capacity(d, None);
            clear_device();
        })
        .join()
        .unwrap();
    }
}
