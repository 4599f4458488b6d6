use super::dag::{Dag, Lane};
use super::{Prediction, StepSpec, predict};

fn predict_ok(spec: &StepSpec) -> Prediction {
    predict(spec).expect("a valid spec")
}

#[test]
fn a_hand_computed_dag() {
    // h2d a (2) -> compute b (3); update c (5) on its own lane; compute d (1) after b and c
    let mut dag = Dag::default();
    let a = dag.add("a", Lane::H2d, 2.0, &[]);
    let b = dag.add("b", Lane::Compute, 3.0, &[a]);
    let c = dag.add("c", Lane::Update, 5.0, &[]);
    let d = dag.add("d", Lane::Compute, 1.0, &[b, c]);
    assert_eq!(dag.finish(b), 5.0);
    assert_eq!(dag.finish(d), 6.0); // c ends at 5 with b: d starts at 5
    assert_eq!(dag.critical_path(d), vec![a, b, d]); // b's finish is the (first) latest
    let e = dag.add("e", Lane::Update, 4.0, &[]); // after c on its lane: 5..9
    let wait = dag.add("wait e", Lane::Host, 0.0, &[e]);
    let f = dag.add("f", Lane::Compute, 1.0, &[]); // issued after the host waited
    assert_eq!(dag.finish(wait), 9.0);
    assert_eq!(dag.ops[f].start_s, 9.0);
    // f's lane was idle from d's end (6) to 9: e (update, 5..9) ran then, after c
    assert_eq!(dag.gap_causes(f, dag.finish(d)), vec![(Lane::Update, 3.0)]);
    assert_eq!(dag.critical_path(f), vec![c, e, wait, f]);
}

fn spec(layers: usize, clipping: bool, update_s: f64) -> StepSpec {
    let groups = layers + 2;
    StepSpec {
        forward_s: vec![1.0; layers],
        backward_s: vec![2.0; layers],
        embed_forward_s: 0.0,
        head_s: 1.0,
        embed_backward_s: 0.0,
        load_s: vec![0.5; groups],
        grad_copy_s: vec![0.5; groups],
        update_s: vec![update_s; groups],
        cast_s: vec![],
        offload_s: vec![],
        reload_s: vec![],
        reduce_s: vec![],
        reduce_blocks: true,
        host_sum_s: vec![],
        resident: vec![],
        all_to_all_forward_s: vec![],
        all_to_all_backward_s: vec![],
        owners: vec![],
        slots: 2,
        grad_slots: 4,
        clipping,
    }
}

#[test]
fn the_all_to_alls_lengthen_a_gpu_bound_step_by_their_sum() {
    // 4 layers, fast host and copies: GPU-bound. Each layer's forward all-to-alls (0.1 s)
    // and backward ones (0.3 s) sit between computes: the step grows by 4 x 0.4 s, on their
    // own lane, and the compute waits that long for it; less at most the base step's 0.02 s
    // tail between steps (the embedding's copy and update), which the last one now hides.
    for clipping in [false, true] {
        let gpu_bound = || StepSpec {
            load_s: vec![0.01; 6],
            grad_copy_s: vec![0.01; 6],
            ..spec(4, clipping, 0.01)
        };
        let base = predict_ok(&gpu_bound());
        let mut context = gpu_bound();
        context.all_to_all_forward_s = vec![0.1; 4];
        context.all_to_all_backward_s = vec![0.3; 4];
        let split = predict_ok(&context);
        let added = split.step_s - base.step_s;
        assert!((1.58..=1.6 + 1e-9).contains(&added), "{base:?} {split:?}");
        assert!((split.busy_s[&Lane::AllToAll] - 1.6).abs() < 1e-9);
        assert!(
            (split.exposed_s[&Lane::AllToAll] - 1.6).abs() < 1e-9,
            "{split:?}"
        );
        context.all_to_all_backward_s = vec![0.3; 3];
        assert!(predict(&context).is_err());
    }
}

#[test]
fn a_blocking_reduction_delays_the_backward_and_an_overlapped_one_hides() {
    // 0.25 s per group's reduction (6 groups). Blocking, as the engine's synchronous
    // collective: the head's and 4 layers' reductions sit between backward computes (+1.25 s),
    // the embedding's before the step's end (hidden by the last copies without clipping). On
    // its own stream, only the last two can show (layer 1's and the embedding's: its backward
    // takes no time here).
    for clipping in [false, true] {
        let base = predict_ok(&spec(4, clipping, 0.1)).step_s;
        let mut reduced = spec(4, clipping, 0.1);
        reduced.reduce_s = vec![0.25; 6];
        let blocking = predict_ok(&reduced);
        let added = blocking.step_s - base;
        assert!(
            (1.25 - 1e-9..=1.5 + 1e-9).contains(&added),
            "{base} {blocking:?}"
        );
        assert!((blocking.busy_s[&Lane::Reduce] - 1.5).abs() < 1e-9);
        reduced.reduce_blocks = false;
        let overlapped = predict_ok(&reduced).step_s;
        assert!(overlapped - base <= 0.5 + 1e-9, "{base} {overlapped}");
    }
}

#[test]
fn fast_updates_leave_the_compute_and_the_step_boundary() {
    // 4 layers: 4 x (1 + 2) + head 1 = 13 s of compute. Between steps: the last gradients'
    // copies (layer 1, embedding: 2 x 0.5), the embedding's update (0.1), then the next step's
    // loads of the embedding and layer 1 (2 x 0.5): 2.1 s that nothing hides
    let p = predict_ok(&spec(4, false, 0.1));
    assert!((p.step_s - 15.1).abs() < 1e-9, "{p:?}");
    assert!((p.busy_s[&Lane::Compute] - 13.0).abs() < 1e-9);
    let exposed: f64 = p.exposed_s.values().sum();
    assert!((exposed - 2.1).abs() < 1e-9, "{p:?}");
    assert!((p.exposed_s[&Lane::Update] - 0.1).abs() < 1e-9, "{p:?}");
}

#[test]
fn slow_updates_bind_the_step_and_show_as_update_waits() {
    // 6 groups x 4 s of AdamW = 24 s per step > 13 s of compute: the update lane sets the pace;
    // the embedding's update is submitted last and needed first, so the next forward also
    // waits for it behind the whole queue
    let p = predict_ok(&spec(4, false, 4.0));
    assert!(p.step_s >= 24.0, "{p:?}");
    assert!(p.exposed_s[&Lane::Update] > 10.0, "{p:?}");
    assert!(p.regime.starts_with("Update-bound"), "{}", p.regime);
}

#[test]
fn clipping_moves_the_updates_after_the_backward() {
    // updates of 1.5 s x 6 = 9 s: without clipping they hide under the backward (13 s step);
    // with clipping they start only when the norm is known and gate the next forward's loads
    let free = predict_ok(&spec(4, false, 1.5));
    let clipped = predict_ok(&spec(4, true, 1.5));
    let update = |p: &Prediction| p.exposed_s.get(&Lane::Update).copied().unwrap_or(0.0);
    assert!(clipped.step_s > free.step_s + 1.0, "{free:?} {clipped:?}");
    assert!(
        update(&clipped) > update(&free) + 1.0,
        "{free:?} {clipped:?}"
    );
}

#[test]
fn one_slot_serializes_each_load_with_the_compute_before_it() {
    let mut one = spec(4, false, 0.1);
    one.slots = 1;
    let two = predict_ok(&spec(4, false, 0.1));
    let p = predict_ok(&one);
    // every load after the first waits for the previous layer's compute: 0.5 s more per load
    // in the forward (3 loads) and the backward (3 reloads)
    assert!((p.step_s - two.step_s - 3.0).abs() < 1e-9, "{p:?} {two:?}");
}

#[test]
fn a_spec_with_a_missing_entry_is_an_error_naming_the_list() {
    let mut bad = spec(4, false, 0.1);
    bad.update_s.pop();
    let err = predict(&bad).unwrap_err().to_string();
    assert!(err.contains("update_s has 5 entries, expected 6"), "{err}");
    let mut bad = spec(4, false, 0.1);
    bad.head_s = f64::NAN;
    assert!(predict(&bad).is_err());
}

#[test]
fn a_cast_on_the_host_delays_every_load_it_precedes() {
    // without the mirror the host casts each group before its load (0.25 s here) and issues
    // nothing meanwhile: the embedding's cast opens the step (exposed), the others run while
    // earlier loads copy (hidden)
    let mut cast = spec(4, false, 0.1);
    cast.cast_s = vec![0.25; 6];
    let p = predict_ok(&cast);
    let base = predict_ok(&spec(4, false, 0.1));
    assert!(
        (p.step_s - base.step_s - 0.25).abs() < 1e-9,
        "{p:?} {base:?}"
    );
    assert!((p.exposed_s[&Lane::Host] - 0.25).abs() < 1e-9, "{p:?}");
    assert!((p.busy_s[&Lane::Host] - 0.25 * 8.0).abs() < 1e-9); // 6 loads + 2 reloads
}

#[test]
fn a_host_sum_runs_on_the_update_lane_before_the_update() {
    // the cpu route: 0.3 s of host sum per group after its copy, on the owner's update worker.
    // Without clipping the six sums sit on the update lane, each before its group's update;
    // the training thread (host lane) does none of them
    let base = predict_ok(&spec(4, false, 0.1));
    let mut summed = spec(4, false, 0.1);
    summed.host_sum_s = vec![0.3; 6];
    let p = predict_ok(&summed);
    assert!(p.busy_s[&Lane::Host] < 1e-9, "{p:?}");
    assert!(
        (p.busy_s[&Lane::Update] - (0.6 + 1.8)).abs() < 1e-9,
        "{p:?}"
    );
    assert!(p.step_s > base.step_s, "{p:?} {base:?}");
    let steps = super::step::build(&summed, 1);
    let (sum, update) = (op_in(&steps, "host sum g3"), op_in(&steps, "update g3"));
    assert_eq!(steps.dag.ops[sum].lane, Lane::Update);
    assert!(steps.dag.ops[update].start_s >= steps.dag.finish(sum));
    // with clipping every gradient is copied and summed twice: for the norm, then to update;
    // the step ends (the norm is known) only once the last norm sum is done
    let mut clipped = spec(4, true, 0.1);
    clipped.host_sum_s = vec![0.3; 6];
    let c = predict_ok(&clipped);
    assert!(c.busy_s[&Lane::Host] < 1e-9, "{c:?}");
    assert!((c.busy_s[&Lane::D2h] - 6.0).abs() < 1e-9, "{c:?}");
    assert!(
        (c.busy_s[&Lane::Update] - (0.6 + 3.6)).abs() < 1e-9,
        "{c:?}"
    );
    clipped.host_sum_s = vec![3.0; 6]; // longer than the backward: the end waits for them
    let steps = super::step::build(&clipped, 1);
    let (end, last_norm_sum) = (op_in(&steps, "t0 end"), op_in(&steps, "host sum (norm) g0"));
    assert!(steps.dag.finish(last_norm_sum) > steps.dag.finish(op_in(&steps, "t0 embed bwd")));
    assert!(steps.dag.ops[end].start_s >= steps.dag.finish(last_norm_sum));
}

fn op_in(steps: &super::step::Steps, name: &str) -> usize {
    steps.dag.ops.iter().position(|o| o.name == name).unwrap()
}

#[test]
fn resident_groups_skip_the_host_and_free_an_update_bound_step() {
    // every group on the host at 4 s of AdamW: update-bound (24 s a step); the embedding, the
    // head and the first three layers GPU-resident: one layer left on the host lane, no load,
    // ring wait, version or update of the others, and the 13 s of compute set the step
    for clipping in [false, true] {
        let host = predict_ok(&spec(4, clipping, 4.0));
        let mut resident = spec(4, clipping, 4.0);
        resident.resident = vec![true, true, true, true, false, true];
        let p = predict_ok(&resident);
        assert!(host.regime.starts_with("Update-bound"), "{}", host.regime);
        assert!(p.step_s < host.step_s - 8.0, "{p:?} {host:?}");
        assert!((p.busy_s[&Lane::Compute] - 13.0).abs() < 1e-9, "{p:?}");
        // one update (layer 4's) of 4 s a step
        assert!((p.busy_s[&Lane::Update] - 4.0).abs() < 1e-9, "{p:?}");
        let steps = super::step::build(&resident, 2);
        let names: Vec<&str> = steps.dag.ops.iter().map(|o| o.name.as_str()).collect();
        for resident_group in ["g0", "g1", "g2", "g3", "g5"] {
            assert!(
                !names
                    .iter()
                    .any(|n| n.ends_with(&format!(" {resident_group}"))),
                "{resident_group}: {names:?}"
            );
        }
        assert!(names.contains(&"update g4"), "{names:?}");
    }
    let mut short = spec(4, false, 4.0);
    short.resident = vec![true; 3];
    assert!(predict(&short).is_err());
}

/// The ranks alternating as owners of `groups` groups (`runtime.dist`'s `group % ranks`).
fn alternating(groups: usize) -> Vec<usize> {
    (0..groups).map(|g| g % 2).collect()
}

#[test]
fn owners_update_on_lanes_of_their_own() {
    for clipping in [false, true] {
        // every group owned by one rank is the one-lane model, bit for bit
        let one = predict_ok(&spec(4, clipping, 4.0));
        let same = predict_ok(&StepSpec {
            owners: vec![0; 6],
            ..spec(4, clipping, 4.0)
        });
        assert_eq!(format!("{one:?}"), format!("{same:?}"));
        // two owners: 12 s of AdamW each, side by side, where one lane ran 24 s (the step
        // 30.5 s -> 20.5 s without clipping)
        let two = predict_ok(&StepSpec {
            owners: alternating(6),
            ..spec(4, clipping, 4.0)
        });
        assert!((two.busy_s[&Lane::Update] - 12.0).abs() < 1e-9, "{two:?}");
        assert!(two.step_s < one.step_s - 8.0, "{two:?} {one:?}");
        assert!(two.step_s >= 12.0, "{two:?}");
    }
}

#[test]
fn the_forward_waits_for_the_embedding_owners_lane() {
    // the embedding's update (6 s) and two layers' (1 s each) on owner 0, three 1 s updates
    // on owner 1: the next step's first forward waits for owner 0's lane, 8 s a step
    let mut heavy = StepSpec {
        owners: alternating(6),
        ..spec(4, false, 1.0)
    };
    heavy.update_s[0] = 6.0;
    let p = predict_ok(&heavy);
    assert!((p.busy_s[&Lane::Update] - 8.0).abs() < 1e-9, "{p:?}");
    assert!(p.step_s >= 8.0 - 1e-9, "{p:?}");
    let steps = super::step::build(&heavy, 3);
    let (update, forward) = (op_in(&steps, "update g0"), op_in(&steps, "t1 embed fwd"));
    assert_eq!(steps.dag.ops[update].unit, 0);
    assert!(steps.dag.ops[forward].start_s >= steps.dag.finish(update));
    // a layer's update of owner 1 runs beside it, on its own lane
    let other = op_in(&steps, "update g1");
    assert_eq!(steps.dag.ops[other].unit, 1);
    assert!(steps.dag.ops[other].start_s < steps.dag.finish(update));
}

#[test]
fn a_gpu_route_owner_sends_into_its_own_ring() {
    // one slot per ring, layer 3's update 10 s (owner 0): layer 2's send (owner 1) waits for
    // the head's update (owner 1's last), not for layer 3's on the other owner's lane; with
    // one ring it would
    let mut slow = StepSpec {
        owners: alternating(6),
        grad_slots: 1,
        ..spec(4, false, 1.0)
    };
    slow.update_s[3] = 10.0;
    let ring_wait = |spec: &StepSpec| {
        let steps = super::step::build(spec, 1);
        let wait = op_in(&steps, "ring wait g2");
        (
            steps.dag.finish(wait),
            steps.dag.finish(op_in(&steps, "update g3")),
        )
    };
    let (waited, slow_update) = ring_wait(&slow);
    assert!(waited < slow_update, "{waited} {slow_update}");
    slow.owners = vec![];
    let (waited, slow_update) = ring_wait(&slow);
    assert!(waited >= slow_update, "{waited} {slow_update}");
}

#[test]
fn gpu_route_owners_copy_on_d2h_lanes_of_their_own() {
    // 3 s copies, updates negligible: with clipping the six copies leave after the backward;
    // two owners copy from their own GPUs side by side (9 s each), where one lane took 18 s
    let mut copies = StepSpec {
        owners: alternating(6),
        grad_copy_s: vec![3.0; 6],
        ..spec(4, true, 0.1)
    };
    let two = predict_ok(&copies);
    assert!((two.busy_s[&Lane::D2h] - 9.0).abs() < 1e-9, "{two:?}");
    let steps = super::step::build(&copies, 2); // step 0's copies leave in step 1
    let units: Vec<usize> = (0..6)
        .map(|g| steps.dag.ops[op_in(&steps, &format!("grad copy g{g}"))].unit)
        .collect();
    assert_eq!(units, alternating(6));
    copies.owners = vec![];
    let one = predict_ok(&copies);
    assert!((one.busy_s[&Lane::D2h] - 18.0).abs() < 1e-9, "{one:?}");
    assert!(two.step_s < one.step_s, "{two:?} {one:?}");
    // the cpu route: every rank copies every group on its one lane, owners or not (twice
    // with clipping: for the norm's sums, then with the coefficient)
    copies.owners = alternating(6);
    copies.host_sum_s = vec![0.1; 6];
    let cpu = predict_ok(&copies);
    assert!((cpu.busy_s[&Lane::D2h] - 36.0).abs() < 1e-9, "{cpu:?}");
}

#[test]
fn a_cpu_route_step_ends_after_every_owners_norm_sums() {
    // layer 1's sum (owner 1) takes 30 s; the embedding's, the backward's last, is on owner
    // 0's lane and done long before: the norm (the engine's take_sum_squares, clipped or not)
    // waits for owner 1's lane all the same
    for (clipping, sum) in [(true, "host sum (norm)"), (false, "host sum")] {
        let mut spec = StepSpec {
            owners: alternating(6),
            host_sum_s: vec![0.3; 6],
            ..spec(4, clipping, 0.1)
        };
        spec.host_sum_s[1] = 30.0;
        let steps = super::step::build(&spec, 1);
        let (end, slow) = (op_in(&steps, "t0 end"), op_in(&steps, &format!("{sum} g1")));
        let last = op_in(&steps, &format!("{sum} g0"));
        assert!(
            steps.dag.finish(last) < steps.dag.finish(slow),
            "{clipping}"
        );
        assert!(
            steps.dag.ops[end].start_s >= steps.dag.finish(slow),
            "{clipping}"
        );
        spec.owners = vec![1; 5];
        assert!(predict(&spec).is_err());
    }
}
