use super::*;
use std::path::PathBuf;

fn spec(layers: usize, staging_slots: usize) -> StoreSpec {
    StoreSpec {
        groups: (0..layers)
            .map(|l| GroupSpec {
                name: format!("layers.{l}"),
                params: vec![
                    ParamSpec {
                        name: format!("layers.{l}.weight"),
                        shape: vec![33, 17],
                        dtype: Dtype::Bf16,
                        frozen: false,
                    },
                    ParamSpec {
                        name: format!("layers.{l}.norm"),
                        shape: vec![17],
                        dtype: Dtype::F32,
                        frozen: false,
                    },
                ],
            })
            .collect(),
        staging_slots,
        chunk_elems: None,
        grad_slots: 2,
        grad_dtype: Some(Dtype::F32),
        bf16_mirror: false,
    }
}

fn shm() -> PathBuf {
    PathBuf::from("/dev/shm")
}

#[test]
fn a_second_mapping_sees_the_first_ones_writes_and_versions() {
    let store = HostStore::create(&spec(3, 2), &shm()).unwrap();
    let other = HostStore::attach(store.name()).unwrap();
    assert_eq!(other.layout(), store.layout());
    assert_ne!(other.base_ptr(), store.base_ptr(), "two distinct mappings");

    let (master, len) = store.region(Region::Master);
    assert_eq!(len, store.layout().state_len * 4);
    assert_eq!(master as usize % 4096, 0);
    let p = store.layout().param("layers.2.norm").unwrap().state_offset;
    // SAFETY: `p` is inside the master region of both mappings, which outlive these accesses.
    unsafe {
        master.cast::<f32>().add(p).write(1.5);
        let (other_master, _) = other.region(Region::Master);
        assert_eq!(other_master.cast::<f32>().add(p).read(), 1.5);
    }

    store.publish(2, 7).unwrap();
    assert_eq!(other.version(2).unwrap(), 7);
    assert_eq!(
        other.wait_version(2, 7, Duration::from_millis(1)).unwrap(),
        7
    );
    assert!(matches!(
        other.wait_version(1, 1, Duration::from_millis(10)),
        Err(Error::VersionTimeout { layer: 1, .. })
    ));
    other.poison();
    assert!(matches!(
        store.wait_version(0, 1, Duration::from_secs(5)),
        Err(Error::StorePoisoned { layer: 0 })
    ));
}

#[test]
fn regions_are_disjoint_and_fit_in_the_mapping() {
    let store = HostStore::create(&spec(2, 3), &shm()).unwrap();
    let end = store.base_ptr() as usize + store.total_bytes();
    let mut spans: Vec<(usize, usize)> = [
        Region::Master,
        Region::ExpAvg,
        Region::ExpAvgSq,
        Region::Grad,
        Region::Staging,
    ]
    .iter()
    .map(|&r| {
        let (ptr, len) = store.region(r);
        (ptr as usize, ptr as usize + len)
    })
    .collect();
    spans.sort();
    for pair in spans.windows(2) {
        assert!(pair[0].1 <= pair[1].0);
    }
    assert!(spans.last().unwrap().1 <= end);
    assert_eq!(
        store.region(Region::Staging).1,
        3 * store.layout().slot_len * 2
    );
}

#[test]
fn too_large_a_store_is_an_error_with_both_byte_counts() {
    let mut huge = spec(1, 1);
    huge.groups[0].params[0].shape = vec![1 << 20, 1 << 20]; // 4 TiB of FP32 per array
    let err = HostStore::create(&huge, &shm()).unwrap_err();
    let Error::OutOfSharedMemory {
        needed_bytes,
        available_bytes,
        ..
    } = err
    else {
        panic!("unexpected error {err}");
    };
    assert!(needed_bytes > 3 * (1u64 << 42));
    assert!(available_bytes < needed_bytes);
    assert!(err_text(&huge).contains(&needed_bytes.to_string()));
}

fn err_text(spec: &StoreSpec) -> String {
    HostStore::create(spec, &shm()).unwrap_err().to_string()
}

#[test]
fn bad_names_are_attach_errors() {
    for name in [
        "nope",
        "slidedp-1-2",
        "other-1-2-3",
        "slidedp-x-2-00",
        "slidedp-999999999-3-00",
    ] {
        assert!(
            matches!(HostStore::attach(name), Err(Error::StoreAttach { .. })),
            "{name}"
        );
    }
    let store = HostStore::create(&spec(1, 1), &shm()).unwrap();
    let wrong_nonce = format!(
        "slidedp-{}-{}-{:016x}",
        std::process::id(),
        store.region.raw_fd(),
        0xdead_u64
    );
    let err = HostStore::attach(&wrong_nonce).unwrap_err();
    assert!(err.to_string().contains("not this store"), "{err}");
}

#[test]
fn nothing_appears_in_the_shm_directory() {
    let before = std::fs::read_dir(shm()).unwrap().count();
    let store = HostStore::create(&spec(2, 1), &shm()).unwrap();
    assert_eq!(std::fs::read_dir(shm()).unwrap().count(), before);
    drop(store);
}

#[test]
fn every_page_is_allocated_and_zero_before_create_returns() {
    let store = HostStore::create(&spec(40, 2), &shm()).unwrap();
    let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: the store's descriptor is open; `stat` is writable storage for one stat.
    let rc = unsafe { libc::fstat(store.region.raw_fd(), stat.as_mut_ptr()) };
    assert_eq!(rc, 0);
    // SAFETY: fstat returned 0, so it filled the struct.
    let allocated = unsafe { stat.assume_init() }.st_blocks as usize * 512;
    assert!(
        allocated >= store.total_bytes(),
        "{allocated} of {} B",
        store.total_bytes()
    );
    // the header, the spec and the version counters before it are written at create
    let (master, _) = store.region(Region::Master);
    let state_len = store.base_ptr() as usize + store.total_bytes() - master as usize;
    // SAFETY: from the master region to the mapping's end is readable while `store` lives.
    let state = unsafe { std::slice::from_raw_parts(master.cast_const(), state_len) };
    assert!(state.iter().all(|&b| b == 0));
}
