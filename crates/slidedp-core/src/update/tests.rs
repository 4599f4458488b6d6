use super::*;
use crate::kernels::Isa;
use crate::store::{GroupSpec, ParamSpec, StoreSpec};
use std::path::Path;

fn store(grad_dtype: Option<Dtype>) -> Arc<HostStore> {
    let p = |name: &str, shape: &[usize]| ParamSpec {
        name: name.into(),
        shape: shape.to_vec(),
        dtype: Dtype::Bf16,
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
        grad_dtype,
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

#[test]
fn updates_match_per_parameter_adamw_with_decay_only_on_matrices() {
    let store = store(Some(Dtype::F32));
    let layout = store.layout().clone();
    // SAFETY: no worker exists yet; this test is the only user of the store.
    let (master, grad) = unsafe { (floats(&store, Region::Master), floats(&store, Region::Grad)) };
    for p in &layout.params {
        for i in 0..p.numel {
            master[p.state_offset + i] = 1.0 + (i as f32) * 0.01;
            grad[p.state_offset + i] = ((i * 7 % 11) as f32 - 5.0) * 0.1;
        }
    }
    let mut expected: Vec<Vec<f32>> = Vec::new();
    let kernels = Kernels::new(1, Isa::Scalar).unwrap();
    for p in &layout.params {
        let range = p.state_offset..p.state_offset + p.numel;
        let (mut w, mut m, mut v) = (
            master[range.clone()].to_vec(),
            vec![0.0; p.numel],
            vec![0.0; p.numel],
        );
        for step in 1..=3 {
            let decay = if p.shape.len() >= 2 { 0.1 } else { 0.0 };
            let h = AdamWStep {
                weight_decay: decay,
                ..hp(step)
            };
            kernels
                .adamw(
                    &h,
                    &mut w,
                    &mut m,
                    &mut v,
                    GradSlice::F32(&grad[range.clone()]),
                    None,
                )
                .unwrap();
        }
        expected.push(w);
    }

    let worker = UpdateWorker::new(store.clone(), Kernels::new(2, Isa::Scalar).unwrap()).unwrap();
    for step in 1..=3u64 {
        for group in [1, 0] {
            worker
                .submit(UpdateRequest {
                    group,
                    hp: hp(step),
                    version: step as u32,
                })
                .unwrap();
        }
    }
    worker.drain(Duration::from_secs(30)).unwrap();
    assert_eq!(store.version(0).unwrap(), 3);
    assert_eq!(store.version(1).unwrap(), 3);
    assert_eq!(worker.stats().0, 6);
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
}

#[test]
fn bad_requests_and_missing_gradients_are_errors() {
    assert!(matches!(
        UpdateWorker::new(store(None), Kernels::new(1, Isa::Scalar).unwrap()),
        Err(Error::InvalidArgument(_))
    ));
    let store = store(Some(Dtype::Bf16));
    let worker = UpdateWorker::new(store.clone(), Kernels::new(1, Isa::Scalar).unwrap()).unwrap();
    assert!(matches!(
        worker.submit(UpdateRequest {
            group: 9,
            hp: hp(1),
            version: 1
        }),
        Err(Error::LayerOutOfRange { layer: 9, .. })
    ));
    // step 0 is rejected by the kernel: the failure is reported by drain and poisons the store.
    worker
        .submit(UpdateRequest {
            group: 0,
            hp: hp(0),
            version: 1,
        })
        .unwrap();
    worker
        .submit(UpdateRequest {
            group: 1,
            hp: hp(1),
            version: 1,
        })
        .unwrap();
    let err = worker.drain(Duration::from_secs(30)).unwrap_err();
    assert!(matches!(err, Error::UpdateFailed { .. }), "{err}");
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
