use super::*;
use crate::kernels::{GradSlice, Isa};
use crate::store::{Dtype, GroupSpec, ParamSpec, Region, StoreSpec};
use std::path::Path;

/// Two groups of four parameters; `chunk_elems` small enough to split each group in chunks.
fn store(
    grad_slots: usize,
    grad_dtype: Option<Dtype>,
    chunk_elems: Option<usize>,
    bf16_mirror: bool,
) -> Arc<HostStore> {
    let p = |name: &str, shape: &[usize]| ParamSpec {
        name: name.into(),
        shape: shape.to_vec(),
        dtype: Dtype::Bf16,
        frozen: false,
    };
    let spec = StoreSpec {
        groups: (0..2)
            .map(|g| GroupSpec {
                name: format!("layers.{g}"),
                params: vec![
                    p(&format!("{g}.w"), &[13, 7]),
                    p(&format!("{g}.b"), &[13]),
                    p(&format!("{g}.norm"), &[7]),
                    p(&format!("{g}.w2"), &[5, 3]),
                ],
            })
            .collect(),
        staging_slots: 1,
        chunk_elems,
        grad_slots,
        grad_dtype,
        bf16_mirror,
    };
    Arc::new(HostStore::create(&spec, Path::new("/dev/shm")).unwrap())
}

/// # Safety
/// `region` of `store` must not be accessed concurrently.
#[allow(clippy::mut_from_ref)] // the slice is the shared mapping, which `&HostStore` keeps alive
unsafe fn floats(store: &HostStore, region: Region) -> &mut [f32] {
    let (ptr, len) = store.region(region);
    // SAFETY: the whole region of a live store, exclusively ours per the caller's contract.
    unsafe { std::slice::from_raw_parts_mut(ptr.cast::<f32>(), len / 4) }
}

fn hp(step: u64) -> AdamWStep {
    AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        step,
        grad_scale: 0.5,
    }
}

fn grad_value(i: usize, step: u64) -> f32 {
    ((i * 7 % 11) as f32 - 5.0) * 0.1 + step as f32 * 0.01
}

fn request(group: usize, start: usize, len: usize, grad_slot: usize, step: u64) -> UpdateRequest {
    UpdateRequest {
        group,
        start,
        len,
        grad_slot,
        hp: hp(step),
        publish: None,
        host_sum: None,
    }
}

/// The chunked, ring-fed worker gives per-parameter AdamW exactly: every chunk boundary, slot
/// reuse and the NaN written into the slots' padding must be invisible in the result.
#[test]
fn chunked_updates_through_a_slot_ring_match_per_parameter_adamw() {
    check_chunked_updates(false);
}

/// With a BF16 mirror, the worker also leaves the cast of every updated parameter there, at its
/// slot offset, bit for bit what the cast kernel gives; the mirror's padding stays zero.
#[test]
fn chunked_updates_emit_the_bf16_mirror() {
    check_chunked_updates(true);
}

fn check_chunked_updates(mirror: bool) {
    let store = store(2, Some(Dtype::F32), Some(48), mirror);
    let layout = store.layout().clone();
    assert!(
        layout.groups[0].state_len > 2 * layout.slot_len,
        "three chunks per group"
    );
    // SAFETY: no worker exists yet; this test is the only user of the store.
    let master = unsafe { floats(&store, Region::Master) };
    for p in &layout.params {
        for i in 0..p.numel {
            master[p.state_offset + i] = 1.0 + (i as f32) * 0.01;
        }
    }
    let kernels = Kernels::new(1, Isa::Scalar).unwrap();
    let mut expected: Vec<Vec<f32>> = Vec::new();
    for p in &layout.params {
        let mut w = master[p.state_offset..p.state_offset + p.numel].to_vec();
        let (mut m, mut v) = (vec![0.0; p.numel], vec![0.0; p.numel]);
        for step in 1..=3 {
            let decay = if p.shape.len() >= 2 { 0.1 } else { 0.0 };
            let h = AdamWStep {
                weight_decay: decay,
                ..hp(step)
            };
            let g: Vec<f32> = (0..p.numel).map(|i| grad_value(i, step)).collect();
            kernels
                .adamw(&h, &mut w, &mut m, &mut v, GradSlice::F32(&g), None)
                .unwrap();
        }
        expected.push(w);
    }

    let worker = UpdateWorker::new(store.clone(), Kernels::new(2, Isa::Scalar).unwrap()).unwrap();
    let (slots, slot_len) = (layout.grad_slots, layout.slot_len);
    let mut slot_reader: Vec<Option<u64>> = vec![None; slots];
    let mut next_slot = 0;
    for step in 1..=3u64 {
        for group in [1, 0] {
            let g = &layout.groups[group];
            let mut start = 0;
            while start < g.state_len {
                let len = slot_len.min(g.state_len - start);
                let k = next_slot;
                next_slot = (next_slot + 1) % slots;
                if let Some(reader) = slot_reader[k] {
                    worker
                        .wait_completed(reader + 1, Duration::from_secs(30))
                        .unwrap();
                }
                // SAFETY: slot k's last reader finished (wait_completed above).
                let slot = unsafe { &mut floats(&store, Region::Grad)[k * slot_len..][..slot_len] };
                slot.fill(f32::NAN); // padding must never be read
                for p in &layout.params[g.params.clone()] {
                    let p_lo = p.state_offset - g.state_offset;
                    for i in 0..p.numel {
                        let at = p_lo + i;
                        if (start..start + len).contains(&at) {
                            slot[at - start] = grad_value(i, step);
                        }
                    }
                }
                let last = start + len == g.state_len;
                let seq = worker
                    .submit(UpdateRequest {
                        publish: last.then_some(step as u32),
                        ..request(group, start, len, k, step)
                    })
                    .unwrap();
                slot_reader[k] = Some(seq);
                start += len;
            }
        }
    }
    worker.drain(Duration::from_secs(30)).unwrap();
    assert_eq!(store.version(0).unwrap(), 3);
    assert_eq!(store.version(1).unwrap(), 3);
    let spans = worker.take_spans();
    assert_eq!(spans.len() as u64, worker.stats().0, "one span per request");
    assert!(spans.iter().all(|s| s.start_s <= s.end_s));
    assert!(
        spans.windows(2).all(|w| w[0].end_s <= w[1].start_s),
        "in order"
    );
    assert!(worker.take_spans().is_empty());
    for (p, want) in layout.params.iter().zip(&expected) {
        let got = &master[p.state_offset..p.state_offset + p.numel];
        assert_eq!(got, want.as_slice(), "{}", p.name);
    }
    let padding_start = layout.params[0].state_offset + layout.params[0].numel;
    assert!(
        master[padding_start..layout.params[1].state_offset]
            .iter()
            .all(|&x| x == 0.0)
    );
    let (ptr, bytes) = store.region(Region::Mirror);
    if !mirror {
        assert_eq!(bytes, 0);
        return;
    }
    // SAFETY: the worker is drained; the mirror is this test's alone now.
    let bf16 = unsafe { std::slice::from_raw_parts(ptr.cast::<u16>(), bytes / 2) };
    let mut written = vec![false; bf16.len()];
    for p in &layout.params {
        let at = layout.groups[p.group].mirror_offset + p.slot_offset;
        let mut want = vec![0u16; p.numel];
        kernels
            .cast_f32_to_bf16(&master[p.state_offset..][..p.numel], &mut want)
            .unwrap();
        assert_eq!(&bf16[at..at + p.numel], want.as_slice(), "{}", p.name);
        written[at..at + p.numel].fill(true);
    }
    let padding: Vec<u16> = (0..bf16.len())
        .filter(|&i| !written[i])
        .map(|i| bf16[i])
        .collect();
    assert!(!padding.is_empty() && padding.iter().all(|&x| x == 0));
}

#[test]
fn an_empty_request_only_publishes() {
    let store = store(1, Some(Dtype::Bf16), None, false);
    let worker = UpdateWorker::new(store.clone(), Kernels::new(1, Isa::Scalar).unwrap()).unwrap();
    let seq = worker
        .submit(UpdateRequest {
            publish: Some(4),
            ..request(1, 0, 0, 0, 1)
        })
        .unwrap();
    worker
        .wait_completed(seq + 1, Duration::from_secs(30))
        .unwrap();
    assert_eq!(store.version(1).unwrap(), 4);
    // SAFETY: the worker is idle.
    let exp_avg_sq = unsafe { floats(&store, Region::ExpAvgSq) };
    assert!(exp_avg_sq.iter().all(|&x| x == 0.0));
}

#[test]
fn bad_requests_and_missing_gradients_are_errors() {
    assert!(matches!(
        UpdateWorker::new(
            store(0, None, None, false),
            Kernels::new(1, Isa::Scalar).unwrap()
        ),
        Err(Error::InvalidArgument(_))
    ));
    let store = store(2, Some(Dtype::Bf16), Some(64), false);
    let worker = UpdateWorker::new(store.clone(), Kernels::new(1, Isa::Scalar).unwrap()).unwrap();
    assert!(matches!(
        worker.submit(request(9, 0, 1, 0, 1)),
        Err(Error::LayerOutOfRange { layer: 9, .. })
    ));
    for bad in [
        request(0, 0, 65, 0, 1),
        request(0, 0, 8, 2, 1),
        request(0, 500, 8, 0, 1),
    ] {
        assert!(
            matches!(worker.submit(bad), Err(Error::InvalidArgument(_))),
            "{bad:?}"
        );
    }
    // step 0 is rejected by the kernel: the failure is reported by drain and poisons the store.
    assert!(worker.failure().is_none());
    worker.submit(request(0, 0, 8, 0, 0)).unwrap();
    worker
        .submit(UpdateRequest {
            publish: Some(1),
            ..request(1, 0, 8, 1, 1)
        })
        .unwrap();
    // a waiter woken by the poison finds the cause at once, before anyone drains
    assert!(matches!(
        store.wait_version(1, 1, Duration::from_secs(30)),
        Err(Error::StorePoisoned { .. })
    ));
    let cause = worker
        .failure()
        .expect("the failure is kept before the store is poisoned");
    assert!(cause.to_string().contains("group 0 step 0"), "{cause}");
    let err = worker.drain(Duration::from_secs(30)).unwrap_err();
    assert!(
        matches!(err, Error::UpdateFailed { first: true, .. }),
        "{err}"
    );
    assert_eq!(
        store.version(1).unwrap(),
        0,
        "requests after a failure are skipped"
    );
    assert!(matches!(
        store.wait_version(1, 1, Duration::from_secs(5)),
        Err(Error::StorePoisoned { .. })
    ));
}

/// Two ranks' updates failing together: the one whose failure claimed the store first
/// reports (`first`); one after a peer's claim does not, though its cause is still its own. A
/// peer's reaction (a poison that claims nothing) takes nothing from a failure after it.
#[test]
fn only_the_first_claimed_failure_is_first() {
    for (peer_claims, first) in [(true, false), (false, true)] {
        let store = store(2, Some(Dtype::Bf16), Some(64), false);
        store.poison(peer_claims); // another process, through the same shared word
        let worker =
            UpdateWorker::new(store.clone(), Kernels::new(1, Isa::Scalar).unwrap()).unwrap();
        worker.submit(request(0, 0, 8, 0, 0)).unwrap(); // step 0: the kernel refuses it
        let err = worker.drain(Duration::from_secs(30)).unwrap_err();
        assert!(
            matches!(err, Error::UpdateFailed { first: f, .. } if f == first),
            "{err:?} (peer claimed: {peer_claims})"
        );
    }
}

/// A half-frozen group: its update covers the trained prefix only, writes the trained
/// parameter's own moments (not the frozen one's master offset), leaves the frozen weights as
/// they were, and a chunk reaching past the prefix is refused.
#[test]
fn a_frozen_parameter_is_never_updated_and_has_no_moments() {
    let p = |name: &str, shape: &[usize], frozen: bool| ParamSpec {
        name: name.into(),
        shape: shape.to_vec(),
        dtype: Dtype::F32,
        frozen,
    };
    let spec = StoreSpec {
        groups: vec![
            GroupSpec {
                name: "embed".into(),
                params: vec![p("e", &[4, 8], true)],
            },
            GroupSpec {
                name: "layer".into(),
                params: vec![p("w", &[6, 8], true), p("n", &[8], false)],
            },
        ],
        staging_slots: 1,
        chunk_elems: None,
        grad_slots: 1,
        grad_dtype: Some(Dtype::F32),
        bf16_mirror: false,
    };
    let store = Arc::new(HostStore::create(&spec, Path::new("/dev/shm")).unwrap());
    let layout = store.layout().clone();
    let n = layout.param("n").unwrap().clone();
    assert_eq!((n.state_offset, n.moment_offset), (32, Some(0)));
    assert_eq!(layout.groups[1].trained_len, 16);
    // SAFETY: no worker runs yet.
    let master = unsafe { floats(&store, Region::Master) };
    master.fill(1.0);
    // SAFETY: as above; the gradient slot is region Grad, f32.
    unsafe { floats(&store, Region::Grad) }.fill(0.5);
    let worker = UpdateWorker::new(store.clone(), Kernels::new(1, Isa::Scalar).unwrap()).unwrap();
    assert!(matches!(
        worker.submit(request(1, 0, 17, 0, 1)),
        Err(Error::InvalidArgument(_))
    ));
    worker.submit(request(1, 0, 16, 0, 1)).unwrap();
    worker.drain(Duration::from_secs(30)).unwrap();
    // SAFETY: the worker is drained.
    let (master, exp_avg) = unsafe {
        (
            floats(&store, Region::Master),
            floats(&store, Region::ExpAvg),
        )
    };
    assert_eq!(
        exp_avg.len(),
        16,
        "the moments of 'n' (8 elements, padded) only"
    );
    assert!(exp_avg[..8].iter().all(|&m| m != 0.0));
    assert!(master[32..40].iter().all(|&w| w != 1.0), "'n' trained");
    assert!(
        master[..32]
            .iter()
            .chain(&master[48..96])
            .all(|&w| w == 1.0)
    );
}
