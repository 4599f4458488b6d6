//! `UpdateWorker::prefault`: a group's state faulted in while the worker idles, no value changed.

use super::prefault::Populated;
use super::thread::Prefaults;
use super::*;
use crate::kernels::Isa;
use crate::store::{Dtype, GroupSpec, ParamSpec, Region, StoreSpec};
use std::path::Path;
use std::time::Instant;

/// Two groups of one [1024, 4096] matrix each: 16 MiB of f32 per group and region, gradient
/// slots of a whole group, the BF16 mirror.
fn big_store() -> Arc<HostStore> {
    let spec = StoreSpec {
        groups: (0..2)
            .map(|g| GroupSpec {
                name: format!("layers.{g}"),
                params: vec![ParamSpec {
                    name: format!("{g}.w"),
                    shape: vec![1024, 4096],
                    dtype: Dtype::Bf16,
                    frozen: false,
                }],
            })
            .collect(),
        staging_slots: 0,
        chunk_elems: None,
        grad_slots: 1,
        grad_dtype: Some(Dtype::F32),
        bf16_mirror: true,
    };
    Arc::new(HostStore::create(&spec, Path::new("/dev/shm")).unwrap())
}

fn bytes(store: &HostStore, region: Region) -> Vec<u8> {
    let (ptr, len) = store.region(region);
    // SAFETY: the whole region of a live store; no update runs while the test reads it.
    unsafe { std::slice::from_raw_parts(ptr, len) }.to_vec()
}

const REGIONS: [Region; 4] = [
    Region::Master,
    Region::ExpAvg,
    Region::ExpAvgSq,
    Region::Mirror,
];

/// A store with master weights and a gradient set, and a worker of two threads.
fn setup() -> (Arc<HostStore>, UpdateWorker) {
    let store = big_store();
    for (region, value) in [(Region::Master, 0.5f32), (Region::Grad, 0.25)] {
        let (ptr, len) = store.region(region);
        // SAFETY: the whole region of a live store, written before any worker exists.
        let floats = unsafe { std::slice::from_raw_parts_mut(ptr.cast::<f32>(), len / 4) };
        for (i, x) in floats.iter_mut().enumerate() {
            *x = value + (i % 97) as f32 * 1e-3;
        }
    }
    let worker = UpdateWorker::new(store.clone(), Kernels::new(2, Isa::detect()).unwrap()).unwrap();
    (store, worker)
}

/// The bytes an update of `group` writes: master, both moments (f32) and the mirror (bf16).
fn group_bytes(store: &HostStore, group: usize) -> u64 {
    let g = &store.layout().groups[group];
    (g.trained_len * 12 + g.slot_len * 2) as u64
}

fn wait_prefaulted(worker: &UpdateWorker, bytes: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while worker.prefaulted_bytes() < bytes && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(worker.prefaulted_bytes(), bytes);
}

/// Minor page faults this thread took while writing one zero per page of `group`'s moments
/// (which are zero: nothing changes).
fn faults_writing_moments(store: &HostStore, group: usize) -> i64 {
    let g = &store.layout().groups[group];
    let page = crate::store::shm::page_bytes() / 4;
    let minor = || {
        // SAFETY: rusage is plain integers, valid all-zero.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: getrusage fills the struct it is given.
        unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
        usage.ru_minflt
    };
    let before = minor();
    for region in [Region::ExpAvg, Region::ExpAvgSq] {
        let base = store.region(region).0.cast::<f32>();
        for i in (g.moment_offset..g.moment_offset + g.trained_len).step_by(page) {
            // SAFETY: inside the region; no worker writes these moments meanwhile.
            unsafe { base.add(i).write_volatile(0.0) };
        }
    }
    minor() - before
}

#[test]
fn a_prefaulted_group_is_written_without_page_faults_and_no_value_changes() {
    let (store, worker) = setup();
    let master = bytes(&store, Region::Master); // read faults map the master, not the moments
    worker.prefault(&[1]).unwrap();
    wait_prefaulted(&worker, group_bytes(&store, 1));
    let pages = (store.layout().groups[0].trained_len * 8 / crate::store::shm::page_bytes()) as i64;
    let (cold, warm) = (
        faults_writing_moments(&store, 0),
        faults_writing_moments(&store, 1),
    );
    assert!(
        cold >= pages / 2,
        "group 0 was never touched: {cold} faults for {pages} pages"
    );
    assert!(
        warm <= 16,
        "group 1 was prefaulted: {warm} faults for {pages} pages"
    );
    assert!(
        bytes(&store, Region::Master) == master,
        "prefaulting changed the master"
    );
    for region in [Region::ExpAvg, Region::ExpAvgSq, Region::Mirror] {
        assert!(
            bytes(&store, region).iter().all(|&b| b == 0),
            "{region:?} changed"
        );
    }
}

/// The first AdamW of all of `group` (one [1024, 4096] matrix), published as version 1.
fn update(group: usize) -> UpdateRequest {
    UpdateRequest {
        group,
        start: 0,
        len: 1024 * 4096,
        grad_slot: 0,
        hp: AdamWStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 1,
            grad_scale: 0.5,
        },
        publish: Some(1),
        host_sum: None,
    }
}

#[test]
fn prefaulting_changes_no_update_and_skips_a_group_updated_first() {
    let (plain, plain_worker) = setup();
    for group in [0, 1] {
        plain_worker.submit(update(group)).unwrap();
    }
    plain_worker.drain(Duration::from_secs(60)).unwrap();

    // group 0 updated before its prefault is sent: only group 1 is faulted in
    let (store, worker) = setup();
    worker.submit(update(0)).unwrap();
    worker.wait_completed(1, Duration::from_secs(60)).unwrap();
    worker.prefault(&[0, 1]).unwrap();
    wait_prefaulted(&worker, group_bytes(&store, 1));
    worker.submit(update(1)).unwrap();
    worker.drain(Duration::from_secs(60)).unwrap();
    assert_eq!(worker.prefaulted_bytes(), group_bytes(&store, 1));
    for region in REGIONS {
        assert!(
            bytes(&plain, region) == bytes(&store, region),
            "{region:?} differs"
        );
    }
}

#[test]
fn a_sum_for_the_norm_alone_or_an_empty_request_leaves_the_group_to_its_prefault() {
    // the cpu route with clipping sums every chunk for the norm in the backward, and updates
    // it (forward order) only after: those sums write no state, so the prefault still runs
    let (store, worker) = setup();
    let norm_only = ChunkSum {
        gather_seq: None,
        norm: true,
        apply: false,
    };
    let requests = [
        UpdateRequest {
            publish: None,
            host_sum: Some(norm_only),
            ..update(1)
        },
        UpdateRequest {
            len: 0,
            ..update(1)
        },
    ];
    for request in requests {
        worker.submit(request).unwrap();
    }
    worker.wait_completed(2, Duration::from_secs(60)).unwrap();
    assert!(worker.take_sum_squares(Duration::from_secs(60)).unwrap() > 0.0);
    worker.prefault(&[1]).unwrap();
    wait_prefaulted(&worker, group_bytes(&store, 1));
}

#[test]
fn prefaulting_an_unknown_group_is_an_error_and_queues_nothing() {
    let (store, worker) = setup();
    assert!(worker.prefault(&[1, 2]).is_err());
    worker.prefault(&[]).unwrap();
    // had the refused call queued group 1, it would be faulted in first: these bytes would
    // be its, with group 0 still to come (faults below), then both groups' (the last check)
    worker.prefault(&[0]).unwrap();
    wait_prefaulted(&worker, group_bytes(&store, 0));
    assert!(faults_writing_moments(&store, 0) <= 16);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(worker.prefaulted_bytes(), group_bytes(&store, 0));
}

#[test]
fn populating_stops_between_pieces_when_interrupted_and_an_interrupted_group_comes_next() {
    let (store, worker) = setup();
    let ranges = prefault::group_ranges(&store, 1).unwrap();
    let kernels = Kernels::new(2, Isa::detect()).unwrap();
    let asked = AtomicU64::new(0);
    let interrupted = || asked.fetch_add(1, Ordering::Relaxed) > 0; // after the first piece
    assert_eq!(
        prefault::populate(&kernels, &ranges, interrupted),
        Populated::Interrupted
    );
    let pages = (store.layout().groups[1].trained_len * 8 / crate::store::shm::page_bytes()) as i64;
    let faults = faults_writing_moments(&store, 1);
    assert!(
        faults >= pages / 2,
        "{faults} faults for {pages} pages: populated on"
    );
    assert_eq!(
        prefault::populate(&kernels, &ranges, || false),
        Populated::Done
    );
    drop(worker);

    let mut prefaults = Prefaults::default();
    prefaults.waiting.extend([0, 1]);
    assert_eq!(prefaults.next(), Some(0));
    prefaults.ended(0, Populated::Interrupted);
    assert_eq!(prefaults.next(), Some(0));
    prefaults.ended(0, Populated::Done);
    assert_eq!(prefaults.next(), Some(1));
    prefaults.ended(1, Populated::Failed);
    prefaults.waiting.push_back(1);
    assert_eq!(prefaults.next(), None);
}

#[test]
fn an_update_submitted_during_a_prefault_runs_and_the_group_is_still_faulted_in_once() {
    let (plain, plain_worker) = setup();
    plain_worker.submit(update(0)).unwrap();
    plain_worker.drain(Duration::from_secs(60)).unwrap();

    let (store, worker) = setup();
    worker.prefault(&[1]).unwrap();
    worker.submit(update(0)).unwrap(); // most likely while group 1 is being faulted in
    worker.drain(Duration::from_secs(60)).unwrap();
    wait_prefaulted(&worker, group_bytes(&store, 1));
    for region in REGIONS {
        assert!(
            bytes(&plain, region) == bytes(&store, region),
            "{region:?} differs"
        );
    }
}
