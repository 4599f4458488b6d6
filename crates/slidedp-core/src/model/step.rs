//! The engine's step (`python/slidedp/runtime/engine.py`) as an operation graph, several steps
//! in a row, so the boundary between steps (version gates, updates of the previous step) is in.
//!
//! Groups are `0` (embedding), `1..=L` (decoder layers) and `L + 1` (final norm and head). Per
//! step: the forward loads every group through a window of `slots` layer slots (a load waits
//! for the group's version, i.e. its update of the previous step, and for the compute that
//! last read its slot), computes each layer and offloads its activations; the head computes
//! the loss and its gradient; the backward reloads each layer (the last `slots` are still
//! resident), the activations one layer ahead, computes the layer's backward and hands the
//! gradient over. Without clipping a gradient goes to the host at once (D2H into a ring of
//! `grad_slots`, then AdamW); with clipping every gradient waits for the end of the backward
//! and leaves in forward order, the host sending a ring's worth ahead of each load of the next
//! step. A step ends when the host has the norm (the backward's end, and without clipping the
//! last gradient copy). With context parallelism each layer's forward and backward are
//! followed by their all-to-alls, which the next compute waits for.
//!
//! Several ranks of a node (`owners`): each group's AdamW (and the cpu route's sum) runs on its
//! owner's update worker, one update lane per owner, in parallel; every rank's next forward
//! waits for every group's version, so the step, synchronous across the ranks, is the one the
//! slowest owner's lane allows. On the gpu route each owner's gradient ring holds its own groups
//! (the owner alone sends them, copying from its own GPU: one D2H lane per owner); on the cpu
//! route every rank sends every group into its ring, on its one D2H lane.

use std::collections::BTreeMap;

use super::dag::{Dag, Lane};
use super::spec::StepSpec;

/// The graph of `steps` steps in a row, with the index of each step's end.
pub struct Steps {
    pub dag: Dag,
    pub ends: Vec<usize>,
    /// Per step, the index range of its operations.
    pub spans: Vec<(usize, usize)>,
}

struct Builder<'a> {
    spec: &'a StepSpec,
    dag: Dag,
    /// The latest update of each group (its version gate).
    updates: Vec<Option<usize>>,
    /// Updates in send order, per ring (`StepSpec::ring_of`): the gradient rings.
    rings: BTreeMap<usize, Vec<usize>>,
    /// The latest gradient landed on the host (copied; cpu route: summed).
    landed: Option<usize>,
    /// The cpu route: this step's latest sum for the norm on each update lane (with clipping
    /// the norm pass's); the norm needs every owner's `Σ g²`.
    norm_sums: BTreeMap<usize, usize>,
    /// Clipping: groups whose gradient waits for its send, and the step end they wait for.
    parked: Vec<usize>,
    backward_end: Option<usize>,
    /// A blocking reduction the next compute operation waits for.
    blocking: Option<usize>,
    /// A layer's all-to-all the next compute operation waits for.
    exchange: Option<usize>,
}

impl Builder<'_> {
    /// Layer `l`'s all-to-alls after its compute `after` (`seconds` of them; none: nothing),
    /// which the next compute waits for.
    fn exchange(&mut self, name: String, seconds: Option<&f64>, after: usize) {
        if let Some(&seconds) = seconds {
            let op = self.dag.add(name, Lane::AllToAll, seconds, &[after]);
            self.exchange = Some(op);
        }
    }

    /// A gradient to the host: a send into a full ring first waits (on the host) for the
    /// update that used the slot; then the copy, then AdamW.
    fn send(&mut self, group: usize, after: &[usize]) {
        let mut deps = after.to_vec();
        let ring = self.rings.entry(self.spec.ring_of(group)).or_default();
        if ring.len() >= self.spec.grad_slots {
            let oldest = ring[ring.len() - self.spec.grad_slots];
            deps.push(
                self.dag
                    .add(format!("ring wait g{group}"), Lane::Host, 0.0, &[oldest]),
            );
        }
        let landed = self.copy_and_sum(group, "", &deps);
        let update = self.dag.add_on(
            format!("update g{group}"),
            self.spec.update_lane(group),
            self.spec.update_s[group],
            &[landed],
        );
        self.rings
            .entry(self.spec.ring_of(group))
            .or_default()
            .push(update);
        self.updates[group] = Some(update);
        self.landed = Some(landed);
        if !self.spec.clipping && self.spec.host_sum(group) > 0.0 {
            self.norm_sums
                .insert(self.spec.update_lane(group).1, landed);
        }
    }

    /// The gradient's copy to the host, then (cpu route) the owner's worker sums the ranks'
    /// copies on its update lane; the operation after which the sum is in the owner's slot.
    fn copy_and_sum(&mut self, group: usize, what: &str, deps: &[usize]) -> usize {
        let copy = self.dag.add_on(
            format!("grad copy{what} g{group}"),
            self.spec.copy_lane(group),
            self.spec.grad_copy_s[group],
            deps,
        );
        if self.spec.host_sum(group) == 0.0 {
            return copy;
        }
        self.dag.add_on(
            format!("host sum{what} g{group}"),
            self.spec.update_lane(group),
            self.spec.host_sum(group),
            &[copy],
        )
    }

    /// Before a load waits for `group`'s version, the parked gradients up to a ring's worth
    /// ahead leave; then the host waits for the group's update of the previous step.
    fn gate(&mut self, t: usize, group: usize) {
        while self
            .parked
            .first()
            .is_some_and(|&p| p <= group + self.spec.grad_slots)
        {
            let p = self.parked.remove(0);
            let after: Vec<usize> = self.backward_end.into_iter().collect();
            self.send(p, &after);
        }
        if self.spec.resident(group) {
            return; // its version is the device's: no host wait
        }
        let deps: Vec<usize> = self.updates[group].into_iter().collect();
        self.dag
            .add(format!("t{t} version g{group}"), Lane::Host, 0.0, &deps);
    }

    /// A load of `group` into the window: the host casts it first (without the mirror); none
    /// for a resident group.
    fn load(&mut self, name: String, group: usize, deps: &[usize]) -> Option<usize> {
        if self.spec.resident(group) {
            return None;
        }
        if self.spec.cast(group) > 0.0 {
            self.dag.add(
                format!("cast g{group}"),
                Lane::Host,
                self.spec.cast(group),
                &[],
            );
        }
        Some(self.dag.add(name, Lane::H2d, self.spec.load_s[group], deps))
    }

    /// A group's gradient exists (`grad`): reduced across ranks and nodes first (when the spec
    /// has reductions), then sent now, or parked until the norm is known (clipping).
    fn hand_over(&mut self, group: usize, grad: usize) -> usize {
        let mut ready = grad;
        if let Some(&seconds) = self.spec.reduce_s.get(group) {
            ready = self
                .dag
                .add(format!("reduce g{group}"), Lane::Reduce, seconds, &[grad]);
            if self.spec.reduce_blocks {
                self.blocking = Some(ready);
            }
        }
        if self.spec.resident(group) {
            return ready; // updated on the device
        }
        if self.spec.clipping {
            if !self.spec.host_sum_s.is_empty() {
                // the cpu route's norm pass: its slot is free again once summed
                let summed = self.copy_and_sum(group, " (norm)", &[ready]);
                self.rings.entry(0).or_default().push(summed);
                self.norm_sums
                    .insert(self.spec.update_lane(group).1, summed);
            }
            self.parked.push(group);
        } else {
            self.send(group, &[ready]);
        }
        ready
    }

    fn step(&mut self, t: usize) -> usize {
        let spec = self.spec;
        let layers = spec.layers();
        self.gate(t, 0);
        let load_embed = self.load(format!("t{t} load embed"), 0, &[]);
        self.dag.add(
            format!("t{t} embed fwd"),
            Lane::Compute,
            spec.embed_forward_s,
            load_embed.as_slice(),
        );
        let mut loads = vec![None; layers + 2];
        let mut slot_users: Vec<usize> = Vec::new(); // the computes that read each slot, in order
        self.gate(t, 1);
        loads[1] = self.load(format!("t{t} load g1"), 1, &[]);
        for l in 1..=layers {
            let next = l + 1; // prefetch: the next layer, or the head into its own buffer
            self.gate(t, next);
            // the next layer's slot is free once its last reader is done: layer l + 1 - slots
            // (with one slot, this very layer: the load then follows its compute)
            let single = spec.slots <= 1 && next <= layers;
            if !single {
                let mut deps = vec![];
                if next <= layers && l >= spec.slots {
                    deps.push(slot_users[l - spec.slots]);
                }
                loads[next] = self.load(format!("t{t} load g{next}"), next, &deps);
            }
            let mut deps: Vec<usize> = loads[l].into_iter().collect();
            deps.extend(self.exchange.take());
            let fwd = self.dag.add(
                format!("t{t} fwd L{l}"),
                Lane::Compute,
                spec.forward_s[l - 1],
                &deps,
            );
            slot_users.push(fwd);
            let a2a = spec.all_to_all_forward_s.get(l - 1);
            self.exchange(format!("t{t} all_to_all fwd L{l}"), a2a, fwd);
            if single {
                loads[next] = self.load(format!("t{t} load g{next}"), next, &[fwd]);
            }
            if spec.offload(l) > 0.0 {
                self.dag.add(
                    format!("t{t} offload L{l}"),
                    Lane::Offload,
                    spec.offload(l),
                    &[fwd],
                );
            }
        }
        let mut deps: Vec<usize> = loads[layers + 1].into_iter().collect();
        deps.extend(self.exchange.take());
        let head = self
            .dag
            .add(format!("t{t} head"), Lane::Compute, spec.head_s, &deps);
        self.hand_over(layers + 1, head);
        for l in (1..=layers).rev() {
            let mut deps = vec![];
            if layers - l >= spec.slots.max(1) {
                // evicted since the forward: loaded again once its slot's last reader is done
                let user = slot_users[slot_users.len() - spec.slots.max(1)];
                deps.extend(self.load(format!("t{t} reload L{l}"), l, &[user]));
            }
            if spec.reload(l) > 0.0 {
                deps.push(self.dag.add(
                    format!("t{t} acts back L{l}"),
                    Lane::Offload,
                    spec.reload(l),
                    &[],
                ));
            }
            deps.extend(self.blocking.take());
            deps.extend(self.exchange.take());
            let bwd = self.dag.add(
                format!("t{t} bwd L{l}"),
                Lane::Compute,
                spec.backward_s[l - 1],
                &deps,
            );
            slot_users.push(bwd);
            let a2a = spec.all_to_all_backward_s.get(l - 1);
            self.exchange(format!("t{t} all_to_all bwd L{l}"), a2a, bwd);
            self.hand_over(l, bwd);
        }
        let mut after: Vec<usize> = self.blocking.take().into_iter().collect();
        after.extend(self.exchange.take());
        let embed = self.dag.add(
            format!("t{t} embed bwd"),
            Lane::Compute,
            spec.embed_backward_s,
            &after,
        );
        let reduced = self.hand_over(0, embed);
        self.blocking = None;
        // the step returns once the host has the norm: the backward done, every gradient
        // reduced (the embedding's is the last) and, without clipping, the last one copied;
        // on the cpu route every lane's last sum for the norm done
        let mut deps = vec![embed, reduced];
        if !spec.clipping {
            deps.extend(self.landed);
        }
        deps.extend(std::mem::take(&mut self.norm_sums).into_values());
        let end = self.dag.add(format!("t{t} end"), Lane::Host, 0.0, &deps);
        self.backward_end = Some(end);
        if spec.clipping {
            self.parked.sort_unstable(); // forward order; as `GradSync.finish`, groups up to the first + the ring leave now
            while self.parked.first().is_some_and(|&p| p <= spec.grad_slots) {
                let p = self.parked.remove(0);
                self.send(p, &[end]);
            }
        }
        end
    }
}

pub fn build(spec: &StepSpec, steps: usize) -> Steps {
    let mut b = Builder {
        spec,
        dag: Dag::default(),
        updates: vec![None; spec.layers() + 2],
        rings: BTreeMap::new(),
        landed: None,
        norm_sums: BTreeMap::new(),
        parked: Vec::new(),
        backward_end: None,
        blocking: None,
        exchange: None,
    };
    let mut ends = Vec::new();
    let mut spans = Vec::new();
    for t in 0..steps {
        let first = b.dag.ops.len();
        ends.push(b.step(t));
        spans.push((first, b.dag.ops.len()));
    }
    Steps {
        dag: b.dag,
        ends,
        spans,
    }
}
