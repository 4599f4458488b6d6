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
    assert!(
        !store.poison(false),
        "a reaction to a peer's failure only wakes"
    );
    assert!(
        other.poison(true),
        "the first failure claims the store, through either mapping, after a reaction too"
    );
    assert!(
        !store.poison(true) && !other.poison(true),
        "later ones do not"
    );
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
        store.region.raw_fds()[0],
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
    assert_allocated_and_zero(&store);
}

/// Every byte of `store`'s parts is allocated, and its state (from the master region to the
/// mapping's end: the header, the spec and the version counters before it are written at
/// create) is zero.
fn assert_allocated_and_zero(store: &HostStore) {
    let allocated: usize = store
        .region
        .raw_fds()
        .iter()
        .map(|&fd| fstat(fd).st_blocks as usize * 512)
        .sum();
    assert!(
        allocated >= store.total_bytes(),
        "{allocated} of {} B",
        store.total_bytes()
    );
    let (master, _) = store.region(Region::Master);
    let state_len = store.base_ptr() as usize + store.total_bytes() - master as usize;
    // SAFETY: from the master region to the mapping's end is readable while `store` lives.
    let state = unsafe { std::slice::from_raw_parts(master.cast_const(), state_len) };
    assert!(state.iter().all(|&b| b == 0));
}

fn fstat(fd: i32) -> libc::stat {
    let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `fd` is an open descriptor of the caller's; `stat` is writable storage for one stat.
    let rc = unsafe { libc::fstat(fd, stat.as_mut_ptr()) };
    assert_eq!(rc, 0);
    // SAFETY: fstat returned 0, so it filled the struct.
    unsafe { stat.assume_init() }
}

/// A store of ~44 MiB (2M values: three FP32 states, two FP32 gradient slots, a BF16 slot).
fn big_spec() -> StoreSpec {
    let mut big = spec(1, 1);
    big.groups[0].params[0].shape = vec![2048, 1024];
    big
}

#[test]
fn a_store_of_several_parts_is_zero_allocated_and_contiguous_across_attaches() {
    let store = HostStore::create_in_parts(&big_spec(), &shm(), PartCount::Exactly(4)).unwrap();
    let fds = store.region.raw_fds();
    assert_eq!(fds.len(), 4, "{}", store.name());
    let lens: Vec<usize> = fds.iter().map(|&fd| fstat(fd).st_size as usize).collect();
    assert_eq!(lens.iter().sum::<usize>(), store.total_bytes());
    assert_allocated_and_zero(&store);

    // write 1 MiB of a pattern straddling the first part boundary (past the header)
    let span = lens[0] - (1 << 19)..lens[0] + (1 << 19);
    // SAFETY: `span` lies inside this mapping, past the header and the spec.
    let written =
        unsafe { std::slice::from_raw_parts_mut(store.base_ptr().add(span.start), span.len()) };
    for (i, b) in written.iter_mut().enumerate() {
        *b = (i % 251) as u8 + 1;
    }
    let other = HostStore::attach(store.name()).unwrap();
    assert_eq!(other.total_bytes(), store.total_bytes());
    // SAFETY: the same span of the second mapping, alive while `other` lives.
    let read = unsafe { std::slice::from_raw_parts(other.base_ptr().add(span.start), span.len()) };
    assert_eq!(read, &*written);
    // and back: the last byte of the region, in the last part, written through the attach
    // SAFETY: the last byte of both mappings.
    unsafe {
        other.base_ptr().add(other.total_bytes() - 1).write(7);
        assert_eq!(store.base_ptr().add(store.total_bytes() - 1).read(), 7);
    }
}

#[test]
fn a_store_of_several_parts_refuses_a_wrong_nonce_or_a_missing_part() {
    let store = HostStore::create_in_parts(&big_spec(), &shm(), PartCount::Exactly(3)).unwrap();
    let fds: Vec<String> = store.region.raw_fds().iter().map(i32::to_string).collect();
    let pid = std::process::id();
    let wrong_nonce = format!("slidedp-{pid}-{}-{:016x}", fds.join("."), 0xdead_u64);
    let err = HostStore::attach(&wrong_nonce).unwrap_err();
    assert!(err.to_string().contains("not this store"), "{err}");
    let nonce = store.name().rsplit('-').next().unwrap();
    let missing = format!("slidedp-{pid}-{}-{nonce}", fds[..2].join("."));
    assert!(matches!(
        HostStore::attach(&missing),
        Err(Error::StoreAttach { .. })
    ));
    let bad_fd = format!("slidedp-{pid}-{}.x-{nonce}", fds[0]);
    assert!(matches!(
        HostStore::attach(&bad_fd),
        Err(Error::StoreAttach { .. })
    ));
}

#[test]
fn too_large_a_store_of_several_parts_is_the_same_clean_error() {
    let mut huge = spec(1, 1);
    huge.groups[0].params[0].shape = vec![1 << 20, 1 << 20];
    let err = HostStore::create_in_parts(&huge, &shm(), PartCount::Exactly(8)).unwrap_err();
    assert!(
        matches!(err, Error::OutOfSharedMemory { needed_bytes, .. } if needed_bytes > 1 << 44),
        "{err}"
    );
}

#[test]
fn parts_are_whole_pages_and_auto_gives_each_core_at_least_a_gibibyte() {
    let page = 4096;
    for (len, k) in [
        (page * 10 + 17, 3),
        (25 << 20, 4),
        (page, 8),
        ((8 << 30) + 5, 7),
    ] {
        let lens = shm::part_lens(len, PartCount::Exactly(k));
        assert_eq!(lens.iter().sum::<usize>(), len);
        assert!(lens.len() <= k && lens.iter().all(|&l| l > 0), "{lens:?}");
        assert!(
            lens[..lens.len() - 1]
                .iter()
                .all(|&l| l.is_multiple_of(page)),
            "{lens:?}"
        );
    }
    let cores = std::thread::available_parallelism().unwrap().get();
    assert_eq!(shm::part_lens(8 << 30, PartCount::Auto).len(), cores.min(8));
    assert_eq!(shm::part_lens((2 << 30) - 1, PartCount::Auto).len(), 1);
}
