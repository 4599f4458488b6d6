use super::*;

fn cand(name: &str, time_s: f64, retained: f64, offloaded: f64) -> Candidate {
    Candidate {
        name: name.into(),
        time_s,
        forward_s: 0.0,
        retained_bytes: retained,
        offloaded_bytes: offloaded,
        transient_bytes: 1.0,
        kind: 0,
    }
}

/// The host lane of `u` seconds per streamed layer, after the backward when `serial`.
fn lane(u: f64, serial: bool) -> Option<HostLane> {
    Some(HostLane {
        update_s_per_layer: u,
        serial,
        tail_s: 0.0,
    })
}

fn resident(bytes_per_layer: f64, max_layers: u32) -> Option<Resident> {
    Some(Resident {
        bytes_per_layer,
        max_layers,
        update_s_per_layer: 0.0,
    })
}

/// F: 10 s, 0 B; SAC: 8 s, 1 B; N: 6 s, 3 B; 10 layers, budget 15 B with 1 B of transient.
/// By hand: SAC saves 2 s per byte and N over SAC 1 s per byte, so fill with SAC (10 B) and
/// upgrade two layers to N with the 4 B left: 8 x 8 + 2 x 6 = 76 s. The runner-up, 3 N + 5 SAC
/// + 2 F, takes 78 s.
fn three() -> Problem {
    Problem {
        layers: 10,
        budget_bytes: 15.0,
        candidates: vec![
            cand("F", 10.0, 0.0, 0.0),
            cand("SAC", 8.0, 1.0, 0.0),
            cand("N", 6.0, 3.0, 0.0),
        ],
        fixed_s: 0.0,
        parked_bytes: 0.0,
        host: None,
        resident: None,
        kinds: vec![],
        host_budget_bytes: None,
    }
}

#[test]
fn the_hand_checked_optimum() {
    let layout = solve(&three()).unwrap();
    assert_eq!(layout.counts, vec![0, 8, 2]);
    assert_eq!(layout.step_s, 76.0);
    assert_eq!(layout.memory_bytes, 15.0);
}

#[test]
fn a_large_budget_takes_the_fastest_everywhere_and_none_takes_the_lightest() {
    let mut p = three();
    p.budget_bytes = 1e6;
    assert_eq!(solve(&p).unwrap().counts, vec![0, 0, 10]);
    p.budget_bytes = 1.0; // only the transient fits: every layer F
    assert_eq!(solve(&p).unwrap().counts, vec![10, 0, 0]);
    p.budget_bytes = 0.5;
    let err = solve(&p).unwrap_err().to_string();
    assert!(err.contains("no layout of 10 layers fits"), "{err}");
}

#[test]
fn the_prefetch_pool_counts_two_offloaded_shares_once() {
    // offloading N (retained 0, 2 B each way) is worth it only while its pool fits
    let mut p = three();
    p.candidates.push(cand("N-r1", 7.0, 0.0, 2.0));
    p.budget_bytes = 5.0; // transient 1 + pool 4: all ten layers offloaded N-r1
    let layout = solve(&p).unwrap();
    assert_eq!(layout.counts, vec![0, 0, 0, 10]);
    assert_eq!(layout.memory_bytes, 5.0);
    p.budget_bytes = 4.5; // the pool does not fit: SAC (1 B each) on three layers, F elsewhere
    assert_eq!(solve(&p).unwrap().counts, vec![7, 3, 0, 0]);
}

#[test]
fn the_offloaded_shares_fit_the_host_budget() {
    // N-r1 (7 s, retained 0, 2 B offloaded) on every layer with a device budget of 5 B (as
    // above); host memory for 6 B of offloaded shares: three N-r1 layers (6 B pinned). By
    // hand, the other seven in the device's 5 - 1 - 4 = 0 B left: F. 3 x 7 + 7 x 10 = 91 s.
    // With the pool's 4 B the device has no room for SAC; the runner-up, 4 SAC + 6 F without
    // offloading, takes 92 s.
    let mut p = three();
    p.candidates.push(cand("N-r1", 7.0, 0.0, 2.0));
    p.budget_bytes = 5.0;
    p.host_budget_bytes = Some(6.0);
    let layout = solve(&p).unwrap();
    assert_eq!(layout.counts, vec![7, 0, 0, 3]);
    assert_eq!((layout.step_s, layout.offloaded_bytes), (91.0, 6.0));
    // no host memory to spare: nothing offloads
    p.host_budget_bytes = Some(0.0);
    let layout = solve(&p).unwrap();
    assert_eq!((layout.counts[3], layout.offloaded_bytes), (0, 0.0));
    // unbounded: every layer N-r1, 20 B pinned
    p.host_budget_bytes = None;
    assert_eq!(solve(&p).unwrap().offloaded_bytes, 20.0);
}

#[test]
fn a_real_profile_solves_with_no_host_memory_to_spare() {
    // the H100 profile's program in raw bytes, its offloading candidates barred by a budget of
    // 0 (the clamp of a host without room): solved, nothing offloaded
    let mut p: Problem = serde_json::from_str(include_str!("h100_profile_problem.json")).unwrap();
    assert!(p.candidates.iter().any(|c| c.offloaded_bytes > 1e8));
    p.host_budget_bytes = Some(0.0);
    let layout = solve(&p).unwrap();
    assert_eq!(layout.offloaded_bytes, 0.0);
    p.host_budget_bytes = Some(1.0); // one byte: no share fits either
    assert_eq!(solve(&p).unwrap().offloaded_bytes, 0.0);
}

#[test]
fn resident_layers_shorten_the_host_lane_where_it_binds() {
    let mut p = three();
    p.budget_bytes = 1e6;
    p.host = lane(9.0, false);
    p.resident = resident(10.0, 10);
    // compute 60 s (all N); host 90 s until 4 layers are resident (9 x 6 = 54 <= 60)
    let layout = solve(&p).unwrap();
    assert_eq!(layout.counts, vec![0, 0, 10]);
    assert!(layout.resident_layers >= 4, "{layout:?}");
    assert_eq!(layout.step_s, 60.0);
    // serial (clipping): every resident layer takes 9 s off the step, so all of them
    p.host = lane(9.0, true);
    let layout = solve(&p).unwrap();
    assert_eq!((layout.resident_layers, layout.step_s), (10, 60.0));
}

#[test]
fn the_resident_update_is_device_time() {
    let mut p = three();
    p.budget_bytes = 1e6;
    p.resident = Some(Resident {
        update_s_per_layer: 2.0,
        ..resident(10.0, 10).unwrap()
    });
    // serial (clipping): after the backward (all N, 60 s) the host lane, 9 s per streamed
    // layer, and the resident layers' device update, 2 s each, run side by side: 60 + max(9
    // (10 - r), 2 r) is 78 s at r = 8 and 9 (80 at 10, 150 with none), and among equal steps
    // the least compute, 60 + 2 r: r = 8
    p.host = lane(9.0, true);
    let layout = solve(&p).unwrap();
    assert_eq!(
        (layout.counts.clone(), layout.resident_layers),
        (vec![0, 0, 10], 8)
    );
    assert_eq!((layout.step_s, layout.compute_s), (78.0, 76.0));
    assert_eq!(layout_of(&p, vec![0, 0, 10], 10).step_s, 80.0);
    // overlapped: compute 60 + r (1 s each) against the lane and the resident backward after
    // it, 9 (10 - r) + 6 r = 90 - 3 r: r = 8 gives max(68, 66) = 68 s, r = 7 max(67, 69) and
    // r = 10 (free updates' choice) 70 s
    if let Some(r) = p.resident.as_mut() {
        r.update_s_per_layer = 1.0;
    }
    p.host = lane(9.0, false);
    let layout = solve(&p).unwrap();
    assert_eq!((layout.resident_layers, layout.step_s), (8, 68.0));
    assert_eq!(layout_of(&p, vec![0, 0, 10], 10).step_s, 70.0);
}

#[test]
fn the_overlapped_host_lane_starts_after_the_forward() {
    let mut p = three();
    p.budget_bytes = 1e6;
    for c in &mut p.candidates {
        c.forward_s = c.time_s / 3.0; // N: 2 s of its 6
    }
    p.host = lane(9.0, false);
    p.resident = resident(10.0, 10);
    // compute 60 s (all N), forward 20 s: the lane ends by 60 s with 6 resident layers
    // (20 + 9 x 4 = 56), where 4 would do if it could overlap the forward (20 + 54 = 74 s);
    // and the resident layers' backward (N's 4 s, the least) follows the lane: 20 + 9 x 4 +
    // 4 x 6 = 80 s with 6, so all 10 (20 + 40 = 60 s)
    let layout = solve(&p).unwrap();
    assert_eq!(layout.counts, vec![0, 0, 10]);
    assert_eq!(layout.resident_layers, 10, "{layout:?}");
    assert_eq!(layout.step_s, 60.0);
    assert_eq!(layout_of(&p, vec![0, 0, 10], 4).step_s, 20.0 + 54.0 + 16.0);
    assert_eq!(layout_of(&p, vec![0, 0, 10], 6).step_s, 80.0);
    // the embedding's update ends every step, after the backward, resident layers or not
    if let Some(h) = p.host.as_mut() {
        h.tail_s = 5.0;
    }
    let layout = solve(&p).unwrap();
    assert_eq!(
        (layout.step_s, layout.host_s),
        (65.0, 5.0 + 9.0 * f64::from(10 - layout.resident_layers))
    );
}

#[test]
fn resident_layers_compete_with_activations_for_the_budget() {
    let mut p = three();
    p.budget_bytes = 21.0; // transient 1 + 20 B
    p.host = lane(4.0, true);
    p.resident = resident(4.0, 10);
    // a resident layer: 4 s for 4 B (1 s/B), an SAC layer 2 s for 1 B, an N upgrade 2 s for 2 B:
    // 10 SAC (10 B) then 10 B shared between N upgrades and resident layers at 1 s/B each
    let layout = solve(&p).unwrap();
    // all SAC: 80 s of compute + 40 s of host, less 10 s: 110 s
    assert_eq!(layout.step_s, 110.0, "{layout:?}");
    assert!(layout.memory_bytes <= 21.0);
}

#[test]
fn bad_costs_are_refused() {
    let mut p = three();
    p.candidates[1].time_s = f64::NAN;
    assert!(
        solve(&p)
            .unwrap_err()
            .to_string()
            .contains("candidate 'SAC'")
    );
    let mut p = three();
    p.resident = Some(Resident {
        update_s_per_layer: -1.0,
        ..resident(10.0, 10).unwrap()
    });
    let err = solve(&p).unwrap_err().to_string();
    assert!(err.contains("update_s_per_layer must be finite"), "{err}");
}

#[test]
fn parked_gradients_must_fit_beside_the_transient() {
    let mut p = three();
    p.parked_bytes = 14.0; // transient 1 + 14 = 15: fits, and the layout is unchanged
    assert_eq!(solve(&p).unwrap().counts, vec![0, 8, 2]);
    p.parked_bytes = 14.5;
    let err = solve(&p).unwrap_err().to_string();
    assert!(err.contains("no layout of 10 layers fits"), "{err}");
}

#[test]
fn among_equal_steps_the_least_compute() {
    // the host lane (100 s) binds every layout: all N (60 s of compute) is chosen
    let mut p = three();
    p.budget_bytes = 1e6;
    p.host = lane(10.0, false);
    let layout = solve(&p).unwrap();
    assert_eq!(
        (layout.counts.clone(), layout.step_s),
        (vec![0, 0, 10], 100.0)
    );
}

#[test]
fn a_real_profile_in_bytes_and_seconds_solves() {
    // a Qwen3-4B B=16 H100 profile's program (times perturbed), host lane overlapping: with the
    // memory rows in raw bytes microlp answered "Singular matrix", read as "does not fit"
    let p: Problem = serde_json::from_str(include_str!("h100_profile_problem.json")).unwrap();
    let layout = solve(&p).unwrap();
    assert_eq!(layout.counts.iter().sum::<u32>(), 36);
    assert!(layout.memory_bytes <= p.budget_bytes);
    // the host lane binds (0.944 s): no layout steps faster
    let host = p.host.as_ref().unwrap().update_s_per_layer * 36.0;
    assert!((layout.step_s - host).abs() < 1e-9, "{layout:?}");
}

#[test]
fn resident_layers_share_a_clipped_steps_end_with_the_parked_gradients() {
    let mut p = three();
    p.budget_bytes = 21.0;
    p.parked_bytes = 12.0; // transient 1 + parked 12: 8 B left for resident layers at the end
    p.host = lane(10.0, true); // a resident layer saves 10 s for 4 B
    p.resident = resident(4.0, 10);
    // without the parked row's resident term, 5 (20 B, every layer F) would fit the budget
    let layout = solve(&p).unwrap();
    assert_eq!(layout.resident_layers, 2, "{layout:?}");
}

fn kind(name: &str, layers: u32, update_s_per_layer: Option<f64>) -> Kind {
    Kind {
        name: name.into(),
        layers,
        update_s_per_layer,
    }
}

/// Kind A (6 layers): F 10 s, 0 B; N 6 s, 2 B (2 s per byte). Kind B (4 layers): F 20 s, 0 B;
/// N 12 s, 8 B (1 s per byte). Transient 1 B each.
fn two_kinds(budget_bytes: f64) -> Problem {
    let of = |k: usize, c: Candidate| Candidate { kind: k, ..c };
    Problem {
        layers: 10,
        budget_bytes,
        candidates: vec![
            of(0, cand("A/F", 10.0, 0.0, 0.0)),
            of(0, cand("A/N", 6.0, 2.0, 0.0)),
            of(1, cand("B/F", 20.0, 0.0, 0.0)),
            of(1, cand("B/N", 12.0, 8.0, 0.0)),
        ],
        fixed_s: 0.0,
        parked_bytes: 0.0,
        host: None,
        resident: None,
        kinds: vec![kind("A", 6, None), kind("B", 4, None)],
        host_budget_bytes: None,
    }
}

#[test]
fn the_hand_checked_optimum_of_two_kinds() {
    // 14 B after the transient: A's N first (2 s/B) on all six layers (12 B); B's N (8 B) no
    // longer fits: 6 x 6 + 4 x 20 = 116 s. Runner-up 3 A/N + 1 B/N (14 B): 18 + 30 + 12 + 60
    // = 120 s.
    let layout = solve(&two_kinds(15.0)).unwrap();
    assert_eq!(layout.counts, vec![0, 6, 4, 0]);
    assert_eq!((layout.step_s, layout.memory_bytes), (116.0, 13.0));
    // 20 B: six A/N (12 B) and one B/N (8 B), 36 + 12 + 60 = 108 s; two B/N and two A/N take
    // the same bytes for 16 + 8 = 24 s saved instead of 32
    let layout = solve(&two_kinds(21.0)).unwrap();
    assert_eq!(layout.counts, vec![0, 6, 3, 1]);
    assert_eq!(layout.step_s, 108.0);
    // any budget: each kind's layers on its own fastest candidate (A's N, at 6 s, is not B's)
    let layout = solve(&two_kinds(1e6)).unwrap();
    assert_eq!(layout.counts, vec![0, 6, 0, 4]);
    assert_eq!(layout.step_s, 84.0);
}

#[test]
fn resident_layers_of_several_kinds_save_the_cheapest_update() {
    let mut p = two_kinds(1e6);
    p.kinds = vec![kind("A", 6, Some(2.0)), kind("B", 4, Some(5.0))];
    p.host = lane(0.0, true);
    p.resident = resident(10.0, 10);
    // all N (84 s); host 6 x 2 + 4 x 5 = 32 s streamed, each resident layer 2 s less
    assert_eq!(layout_of(&p, vec![0, 6, 0, 4], 0).host_s, 32.0);
    assert_eq!(layout_of(&p, vec![0, 6, 0, 4], 3).host_s, 26.0);
    let layout = solve(&p).unwrap();
    assert_eq!((layout.resident_layers, layout.step_s), (10, 84.0 + 12.0));
}

#[test]
fn kinds_must_cover_the_layers_and_have_candidates() {
    let mut p = two_kinds(15.0);
    p.kinds[1].layers = 5;
    let err = solve(&p).unwrap_err().to_string();
    assert!(err.contains("kinds' layers sum to 11"), "{err}");
    let mut p = two_kinds(15.0);
    p.candidates.retain(|c| c.kind == 0);
    let err = solve(&p).unwrap_err().to_string();
    assert!(err.contains("kind 'B' has no candidate"), "{err}");
    let mut p = two_kinds(15.0);
    p.candidates[0].kind = 2;
    let err = solve(&p).unwrap_err().to_string();
    assert!(err.contains("'A/F': no kind 2"), "{err}");
}
