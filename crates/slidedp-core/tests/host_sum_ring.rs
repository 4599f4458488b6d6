//! The cpu gradient route across threads: each thread is a rank with its own update worker over
//! one shared store; the ranks' training threads only copy (into their landing slots, bf16 or
//! f32), announce and submit, the owners' workers wait for the peers' chunks, sum them into
//! their f32 slots, take `Σ g²` and run AdamW. Results must equal AdamW on the f32 sum of the
//! ranks' widened copies in the owner's order, bit for bit, with exact global-norm clipping.

use std::path::Path;
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use slidedp_core::Error;
use slidedp_core::kernels::{AdamWStep, GradSlice, Isa, Kernels};
use slidedp_core::store::{Dtype, GroupSpec, HostStore, ParamSpec, Region, StoreSpec};
use slidedp_core::update::{ChunkSum, HostSumRing, UpdateRequest, UpdateWorker};

const RANKS: usize = 3;
const SLOTS_PER_RANK: usize = 2; // fewer than a step's chunks: the ring wraps and waits
const TIMEOUT: Duration = Duration::from_secs(60);
const MAX_NORM: f64 = 4.0;

fn param(name: String, shape: &[usize]) -> ParamSpec {
    ParamSpec {
        name,
        shape: shape.to_vec(),
        dtype: Dtype::Bf16,
        frozen: false,
    }
}

/// Three groups of three parameters (odd sizes: padding between them), chunks of 40 elements,
/// gradient slots in `grad_dtype`; the signals with `landing` slots of the same length.
fn stores(grad_dtype: Dtype, landing: Option<Dtype>) -> (Arc<HostStore>, Arc<HostStore>) {
    let groups = (0..3)
        .map(|g| GroupSpec {
            name: format!("layers.{g}"),
            params: vec![
                param(format!("{g}.w"), &[9, 7]),
                param(format!("{g}.b"), &[9]),
                param(format!("{g}.w2"), &[5, 3]),
            ],
        })
        .collect();
    let spec = StoreSpec {
        groups,
        staging_slots: 0,
        chunk_elems: Some(40),
        grad_slots: RANKS * SLOTS_PER_RANK,
        grad_dtype: Some(grad_dtype),
        bf16_mirror: false,
    };
    let counters = (0..HostSumRing::signal_count(RANKS, SLOTS_PER_RANK))
        .map(|i| GroupSpec {
            name: format!("signal.{i}"),
            params: vec![param(format!("signal.{i}"), &[1])],
        })
        .collect();
    let signals = StoreSpec {
        groups: counters,
        staging_slots: 0,
        chunk_elems: Some(40),
        grad_slots: if landing.is_some() {
            spec.grad_slots
        } else {
            0
        },
        grad_dtype: landing,
        bf16_mirror: false,
    };
    let shm = Path::new("/dev/shm");
    (
        Arc::new(HostStore::create(&spec, shm).unwrap()),
        Arc::new(HostStore::create(&signals, shm).unwrap()),
    )
}

/// Rank `rank`'s gradient of element `i` of a parameter at `step`: distinct per rank, exact in
/// bf16 (at most 7 significant bits), and ranks 1 and 2 of opposite signs at 2^22 times rank
/// 0's scale, so that the f32 sum rounds differently in another order (`check_route` shows it).
fn grad(rank: usize, i: usize, step: u64) -> f32 {
    let base =
        ((i * 7 + rank * 3) % 13) as f32 * 0.25 - 1.5 + step as f32 * 0.125 + rank as f32 * 0.5;
    base * [1.0, 4194304.0, -4194304.0][rank]
}

/// `grad`'s bf16 bits (exact: its low 16 bits are zero).
fn grad_bf16(rank: usize, i: usize, step: u64) -> u16 {
    let bits = grad(rank, i, step).to_bits();
    assert_eq!(bits & 0xFFFF, 0, "not exact in bf16");
    (bits >> 16) as u16
}

fn hp(step: u64, grad_scale: f64) -> AdamWStep {
    AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        step,
        grad_scale,
    }
}

/// # Safety
/// Nobody else may access `region` of `store` while the slice lives.
#[allow(clippy::mut_from_ref)] // the slice is the shared mapping, which `&HostStore` keeps alive
unsafe fn floats(store: &HostStore, region: Region) -> &mut [f32] {
    let (ptr, len) = store.region(region);
    // SAFETY: the whole region of a live store, exclusive per the caller's contract.
    unsafe { std::slice::from_raw_parts_mut(ptr.cast::<f32>(), len / 4) }
}

/// # Safety
/// As [`floats`].
#[allow(clippy::mut_from_ref)] // the slice is the shared mapping, which `&HostStore` keeps alive
unsafe fn halves(store: &HostStore, region: Region) -> &mut [u16] {
    let (ptr, len) = store.region(region);
    // SAFETY: the whole region of a live store, exclusive per the caller's contract.
    unsafe { std::slice::from_raw_parts_mut(ptr.cast::<u16>(), len / 2) }
}

/// Who last read one of a rank's slots: its own worker's request `n`, or the owner's sum of
/// chunk `seq`.
#[derive(Clone, Copy)]
enum Reader {
    Update(u64),
    Sum(u64),
}

/// One rank's training thread: the gradient lane's protocol (`runtime/grad_lane.py`).
struct Rank {
    rank: usize,
    store: Arc<HostStore>,
    signals: Arc<HostStore>,
    worker: UpdateWorker,
    readers: Vec<Option<Reader>>,
    next_slot: usize,
    sent: u64,
}

impl Rank {
    fn ring(&self) -> &HostSumRing {
        self.worker.ring().unwrap()
    }

    /// Copies elements `[start, start + len)` of `group`'s gradient at `step` into landing slot
    /// `slot_index` in the landing dtype, the gaps between parameters zero (as the engine
    /// copies them).
    fn land(&self, slot_index: usize, group: usize, start: usize, len: usize, step: u64) {
        let layout = self.store.layout();
        let g = &layout.groups[group];
        let pieces: Vec<(usize, usize)> = layout.params[g.params.clone()]
            .iter()
            .flat_map(|p| {
                let p_lo = p.state_offset - g.state_offset;
                (0..p.numel)
                    .filter(move |i| (start..start + len).contains(&(p_lo + i)))
                    .map(move |i| (p_lo + i - start, i))
            })
            .collect();
        let range = slot_index * layout.slot_len..(slot_index + 1) * layout.slot_len;
        if self.signals.layout().grad_dtype == Some(Dtype::Bf16) {
            // SAFETY: the landing slot is this rank's and its last reader is done (waited).
            let slot = unsafe { &mut halves(&self.signals, Region::Grad)[range] };
            slot.fill(0);
            for (at, i) in pieces {
                slot[at] = grad_bf16(self.rank, i, step);
            }
        } else {
            // SAFETY: as above.
            let slot = unsafe { &mut floats(&self.signals, Region::Grad)[range] };
            slot.fill(0.0);
            for (at, i) in pieces {
                slot[at] = grad(self.rank, i, step);
            }
        }
    }

    /// Sends every chunk of `group`'s gradient at `step`; the owner (`group % RANKS`) submits
    /// `sum` with each, and publishes `step` after the last when `sum.apply`.
    fn send(&mut self, group: usize, step: u64, sum: ChunkSum, grad_scale: f64) {
        let layout = self.store.layout().clone();
        let g = &layout.groups[group];
        let mut start = 0;
        while start < g.state_len {
            let len = layout.slot_len.min(g.state_len - start);
            let k = self.next_slot;
            self.next_slot = (k + 1) % SLOTS_PER_RANK;
            match self.readers[k] {
                Some(Reader::Update(n)) => self.worker.wait_completed(n + 1, TIMEOUT).unwrap(),
                Some(Reader::Sum(seq)) => self.ring().wait_consumed(k, seq).unwrap(),
                None => {}
            }
            let slot_index = self.rank * SLOTS_PER_RANK + k;
            self.land(slot_index, group, start, len, step);
            let seq = self.sent;
            self.sent += 1;
            self.ring().landed(seq).unwrap();
            let last = start + len == g.state_len;
            self.readers[k] = Some(if group % RANKS == self.rank {
                let host_sum = Some(ChunkSum {
                    gather_seq: Some(seq),
                    ..sum
                });
                let request = UpdateRequest {
                    group,
                    start,
                    len,
                    grad_slot: slot_index,
                    hp: hp(step, grad_scale),
                    publish: (last && sum.apply).then_some(step as u32),
                    host_sum,
                };
                Reader::Update(self.worker.submit(request).unwrap())
            } else {
                Reader::Sum(seq)
            });
            start += len;
        }
    }
}

/// Each rank's `Σ g²` of its owned sums, then every rank's, as `GradSync._global_norm` adds them.
struct NormExchange {
    barrier: Barrier,
    owned: Mutex<Vec<f64>>,
}

impl NormExchange {
    fn global_norm(&self, rank: usize, owned: f64) -> f64 {
        self.owned.lock().unwrap()[rank] = owned;
        self.barrier.wait();
        let total = self.owned.lock().unwrap().iter().sum::<f64>().sqrt();
        self.barrier.wait(); // everyone read it before the next step writes
        total
    }
}

/// Steps 1..=3 of the cpu route on `RANKS` threads: returns the global norm of each step.
fn train(store: &Arc<HostStore>, signals: &Arc<HostStore>, clipping: bool) -> Vec<f64> {
    let exchange = Arc::new(NormExchange {
        barrier: Barrier::new(RANKS),
        owned: Mutex::new(vec![0.0; RANKS]),
    });
    let threads: Vec<_> = (0..RANKS)
        .map(|rank| {
            let (store, signals, exchange) = (store.clone(), signals.clone(), exchange.clone());
            let signals_of_rank = signals.clone();
            std::thread::spawn(move || {
                let kernels = Kernels::new(2, Isa::Scalar).unwrap();
                let ring =
                    HostSumRing::new(store.clone(), signals, rank, RANKS, SLOTS_PER_RANK, TIMEOUT)
                        .unwrap();
                let worker = UpdateWorker::with_ring(store.clone(), kernels, ring).unwrap();
                let mut me = Rank {
                    rank,
                    store,
                    signals: signals_of_rank,
                    worker,
                    readers: vec![None; SLOTS_PER_RANK],
                    next_slot: 0,
                    sent: 0,
                };
                let mut norms = vec![];
                for step in 1..=3u64 {
                    let norm_pass = ChunkSum {
                        gather_seq: None,
                        norm: true,
                        apply: !clipping,
                    };
                    for group in [2, 1, 0] {
                        me.send(group, step, norm_pass, 1.0);
                    }
                    let owned = me.worker.take_sum_squares(TIMEOUT).unwrap();
                    let norm = exchange.global_norm(rank, owned);
                    norms.push(norm);
                    if clipping {
                        let coef = (MAX_NORM / (norm + 1e-6)).min(1.0);
                        let update = ChunkSum {
                            gather_seq: None,
                            norm: false,
                            apply: true,
                        };
                        for group in [0, 1, 2] {
                            me.send(group, step, update, coef);
                        }
                    }
                    for group in 0..3 {
                        me.store.wait_version(group, step as u32, TIMEOUT).unwrap();
                    }
                }
                me.worker.drain(TIMEOUT).unwrap();
                assert_eq!(me.worker.take_sum_squares(TIMEOUT).unwrap(), 0.0);
                norms
            })
        })
        .collect();
    let norms: Vec<Vec<f64>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(norms.iter().all(|n| *n == norms[0]), "{norms:?}");
    norms[0].clone()
}

/// The same steps done by hand: each group's gradient summed in the owner's order (its own
/// first, then the others by rank, in f32; `owner_first` false: in rank order), the norm of
/// the summed chunks, AdamW per parameter.
fn reference(store: &HostStore, clipping: bool, owner_first: bool) -> (Vec<Vec<f32>>, Vec<f64>) {
    let layout = store.layout();
    let kernels = Kernels::new(1, Isa::Scalar).unwrap();
    let summed = |group: usize, numel: usize, step: u64| -> Vec<f32> {
        let owner = if owner_first { group % RANKS } else { 0 };
        let order = std::iter::once(owner).chain((0..RANKS).filter(|&r| r != owner));
        let mut sum = vec![0.0f32; numel];
        for (n, r) in order.enumerate() {
            for (i, s) in sum.iter_mut().enumerate() {
                *s = if n == 0 {
                    grad(r, i, step)
                } else {
                    *s + grad(r, i, step)
                };
            }
        }
        sum
    };
    let mut masters: Vec<Vec<f32>> = layout.params.iter().map(|p| vec![1.0; p.numel]).collect();
    let mut moments: Vec<(Vec<f32>, Vec<f32>)> = layout
        .params
        .iter()
        .map(|p| (vec![0.0; p.numel], vec![0.0; p.numel]))
        .collect();
    let mut norms = vec![];
    for step in 1..=3u64 {
        // the chunks' Σ g², added per owner in its send order, then the owners in rank order
        let mut owned = [0.0f64; RANKS];
        for group in [2, 1, 0] {
            let g = &layout.groups[group];
            let mut chunk = vec![0.0f32; g.state_len];
            for p in &layout.params[g.params.clone()] {
                let lo = p.state_offset - g.state_offset;
                chunk[lo..lo + p.numel].copy_from_slice(&summed(group, p.numel, step));
            }
            for piece in chunk.chunks(layout.slot_len) {
                owned[group % RANKS] += kernels.sum_squares(GradSlice::F32(piece));
            }
        }
        let norm = owned.iter().sum::<f64>().sqrt();
        norms.push(norm);
        let coef = if clipping {
            (MAX_NORM / (norm + 1e-6)).min(1.0)
        } else {
            1.0
        };
        for (i, p) in layout.params.iter().enumerate() {
            let decay = if p.shape.len() >= 2 { 0.1 } else { 0.0 };
            let h = AdamWStep {
                weight_decay: decay,
                ..hp(step, coef)
            };
            let g = summed(p.group, p.numel, step);
            let (m, v) = &mut moments[i];
            kernels
                .adamw(&h, &mut masters[i], m, v, GradSlice::F32(&g), None)
                .unwrap();
        }
    }
    (masters, norms)
}

fn check_route(landing: Dtype, clipping: bool) {
    let (store, signals) = stores(Dtype::F32, Some(landing));
    // SAFETY: no worker exists yet.
    let master = unsafe { floats(&store, Region::Master) };
    for p in &store.layout().params {
        master[p.state_offset..p.state_offset + p.numel].fill(1.0);
    }
    let norms = train(&store, &signals, clipping);
    let (want, want_norms) = reference(&store, clipping, true);
    assert_eq!(norms, want_norms);
    // the order is seen: summed in plain rank order, the f32 sums round otherwise (their
    // norms differ; AdamW's masters hardly see a rounding of gradients this large)
    let (_, other_order) = reference(&store, clipping, false);
    assert_ne!(want_norms, other_order);
    if clipping {
        assert!(
            norms.iter().all(|&n| n > MAX_NORM),
            "clipping binds: {norms:?}"
        );
    }
    for (p, want) in store.layout().params.iter().zip(&want) {
        assert_eq!(
            &master[p.state_offset..p.state_offset + p.numel],
            want.as_slice(),
            "{}",
            p.name
        );
    }
}

/// Without clipping each chunk is summed once, its `Σ g²` counted, and updated at once.
#[test]
fn three_ranks_sum_on_their_workers_and_match_adamw_on_the_summed_gradient() {
    check_route(Dtype::Bf16, false);
    check_route(Dtype::F32, false); // f32 compute lands f32 copies
}

/// With clipping each chunk is summed for the norm (nothing updated), then sent again, summed
/// again and updated with the coefficient: exact global-norm clipping.
#[test]
fn three_ranks_clip_with_the_exact_global_norm_of_their_sums() {
    check_route(Dtype::Bf16, true);
    check_route(Dtype::F32, true);
}

fn owner_request(seq: u64, grad_slot: usize) -> UpdateRequest {
    UpdateRequest {
        group: 0,
        start: 0,
        len: 40,
        grad_slot,
        hp: hp(1, 1.0),
        publish: Some(1),
        host_sum: Some(ChunkSum {
            gather_seq: Some(seq),
            norm: true,
            apply: true,
        }),
    }
}

fn ring(
    store: &Arc<HostStore>,
    signals: &Arc<HostStore>,
    rank: usize,
    timeout: Duration,
) -> HostSumRing {
    HostSumRing::new(
        store.clone(),
        signals.clone(),
        rank,
        RANKS,
        SLOTS_PER_RANK,
        timeout,
    )
    .unwrap()
}

/// The owner's thread submits and goes on: the wait for the peers is its worker's.
#[test]
fn the_owner_waits_for_its_peers_on_its_worker_not_on_its_thread() {
    let (store, signals) = stores(Dtype::F32, Some(Dtype::Bf16));
    let kernels = Kernels::new(1, Isa::Scalar).unwrap();
    let owner = UpdateWorker::with_ring(store.clone(), kernels, ring(&store, &signals, 0, TIMEOUT))
        .unwrap();
    owner.ring().unwrap().landed(0).unwrap();
    let seq = owner.submit(owner_request(0, 0)).unwrap();
    let short = Duration::from_millis(200);
    assert!(matches!(
        owner.wait_completed(seq + 1, short),
        Err(Error::UpdateTimeout { pending: 1, .. })
    ));
    assert!(matches!(
        owner.take_sum_squares(short),
        Err(Error::UpdateTimeout { pending: 1, .. })
    ));
    let peers: Vec<HostSumRing> = (1..RANKS)
        .map(|r| ring(&store, &signals, r, TIMEOUT))
        .collect();
    for peer in &peers {
        peer.landed(0).unwrap();
    }
    owner.wait_completed(seq + 1, TIMEOUT).unwrap();
    assert_eq!(store.version(0).unwrap(), 1);
    for peer in &peers {
        peer.wait_consumed(0, 0).unwrap(); // their slot 0 is free again
    }
}

/// A peer that never copies: the owner's worker times out, keeps the failure as its own,
/// and poisons both stores so that no rank hangs.
#[test]
fn a_silent_peer_fails_the_owners_worker_and_wakes_everyone() {
    let (store, signals) = stores(Dtype::F32, Some(Dtype::Bf16));
    let kernels = Kernels::new(1, Isa::Scalar).unwrap();
    let timeout = Duration::from_millis(100);
    let owner = UpdateWorker::with_ring(store.clone(), kernels, ring(&store, &signals, 0, timeout))
        .unwrap();
    owner.submit(owner_request(0, 1)).unwrap();
    let err = owner.drain(TIMEOUT).unwrap_err();
    assert!(matches!(err, Error::UpdateFailed { .. }), "{err}");
    assert!(err.to_string().contains("timed out"), "{err}");
    assert!(owner.failure().is_some());
    let peer = ring(&store, &signals, 1, TIMEOUT);
    assert!(matches!(
        peer.wait_consumed(1, 0),
        Err(Error::StorePoisoned { .. })
    ));
    assert!(matches!(
        store.wait_version(0, 1, TIMEOUT),
        Err(Error::StorePoisoned { .. })
    ));
}

/// A peer that failed poisoned the signals: the owner's worker stops with the poison, which
/// is not its own failure (the peer reports the cause).
#[test]
fn a_failed_peer_stops_the_owners_worker_without_blaming_it() {
    let (store, signals) = stores(Dtype::F32, Some(Dtype::Bf16));
    let kernels = Kernels::new(1, Isa::Scalar).unwrap();
    let owner = UpdateWorker::with_ring(store.clone(), kernels, ring(&store, &signals, 0, TIMEOUT))
        .unwrap();
    owner.submit(owner_request(0, 0)).unwrap();
    signals.poison(true);
    let err = owner.drain(TIMEOUT).unwrap_err();
    assert!(matches!(err, Error::StorePoisoned { .. }), "{err}");
    assert!(owner.failure().is_none());
}

#[test]
fn bad_rings_and_host_sums_are_errors() {
    let (store, signals) = stores(Dtype::F32, Some(Dtype::Bf16));
    let invalid = |r: Result<HostSumRing, Error>| matches!(r, Err(Error::InvalidArgument(_)));
    let (bf16_store, _) = stores(Dtype::Bf16, Some(Dtype::Bf16));
    let (_, no_landing) = stores(Dtype::F32, None);
    assert!(invalid(HostSumRing::new(
        store.clone(),
        no_landing,
        0,
        RANKS,
        SLOTS_PER_RANK,
        TIMEOUT
    )));
    assert!(invalid(HostSumRing::new(
        bf16_store,
        signals.clone(),
        0,
        RANKS,
        SLOTS_PER_RANK,
        TIMEOUT
    )));
    assert!(invalid(HostSumRing::new(
        store.clone(),
        signals.clone(),
        3,
        RANKS,
        SLOTS_PER_RANK,
        TIMEOUT
    )));
    assert!(invalid(HostSumRing::new(
        store.clone(),
        signals.clone(),
        0,
        RANKS,
        1,
        TIMEOUT
    )));
    assert!(invalid(HostSumRing::new(
        store.clone(),
        signals.clone(),
        0,
        RANKS + 1,
        1,
        TIMEOUT
    )));
    let kernels = || Kernels::new(1, Isa::Scalar).unwrap();
    let plain = UpdateWorker::new(store.clone(), kernels()).unwrap();
    assert!(matches!(
        plain.submit(owner_request(0, 0)),
        Err(Error::InvalidArgument(_))
    ));
    let short = Duration::from_millis(10); // nobody lands: the accepted request times out
    let rank1 = UpdateWorker::with_ring(store.clone(), kernels(), ring(&store, &signals, 1, short))
        .unwrap();
    // slot 0 is rank 0's: rank 1 sums into its own slots only
    assert!(matches!(
        rank1.submit(owner_request(0, 0)),
        Err(Error::InvalidArgument(_))
    ));
    rank1.submit(owner_request(0, SLOTS_PER_RANK)).unwrap();
}
