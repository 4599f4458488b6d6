//! The step-time model's input: the service times of one step's operations, per group and per
//! layer, as the JSON seam (`slidedp.plan.step_spec`) carries them; [`super::step`] lays them
//! out as the engine's step.

use serde::{Deserialize, Serialize};

use super::dag::Lane;
use crate::{Error, Result};

/// Service times of one step's operations, seconds (per group: embedding, layers, head).
/// Unknown fields are refused: a field misnamed on either side of the JSON seam
/// (`slidedp.plan.step_spec`) is an error, not a default.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepSpec {
    /// Forward compute per decoder layer.
    pub forward_s: Vec<f64>,
    /// Backward compute per decoder layer (the replay included).
    pub backward_s: Vec<f64>,
    /// Embedding forward, head (loss forward and backward), embedding backward.
    pub embed_forward_s: f64,
    pub head_s: f64,
    pub embed_backward_s: f64,
    /// Per group (`L + 2`): a load into the window, a gradient's copy to the host, its AdamW.
    pub load_s: Vec<f64>,
    pub grad_copy_s: Vec<f64>,
    pub update_s: Vec<f64>,
    /// Per group: the host's cast of the group to BF16 before a load (empty: loads from the
    /// BF16 mirror, no cast). The host thread does it, so it also delays what it issues next.
    #[serde(default)]
    pub cast_s: Vec<f64>,
    /// Per decoder layer: the activation offload copy, and its copy back.
    #[serde(default)]
    pub offload_s: Vec<f64>,
    #[serde(default)]
    pub reload_s: Vec<f64>,
    /// Per group: the gradient's reduction across ranks and nodes before it goes to the host
    /// (empty: one rank). The engine issues it as a synchronous collective: the compute stream
    /// waits for it before the next layer's backward (`reduce_blocks`), or, when false, it
    /// runs beside the backward on its own stream.
    #[serde(default)]
    pub reduce_s: Vec<f64>,
    #[serde(default = "blocks")]
    pub reduce_blocks: bool,
    /// Per group: the cpu gradient route's sum of the ranks' copies on the host (empty: none).
    /// The owner's update worker sums once the group's copies have landed, then runs its
    /// AdamW: the sum is on the update lane, ahead of the update, and the training thread only
    /// issues. With clipping the route sends each gradient twice: once during the backward
    /// for the norm (copy and sum, no update), then again with the coefficient. Clipped or
    /// not, the step ends once every update lane's last sum for the norm is done (the norm
    /// needs every sum's `Σ g²`).
    #[serde(default)]
    pub host_sum_s: Vec<f64>,
    /// Per group: GPU-resident (empty: none). A resident group is never loaded, cast, copied
    /// to the host nor updated there (its AdamW runs on the device, in its compute times), and
    /// its next forward waits for no host version; one rank only.
    #[serde(default)]
    pub resident: Vec<bool>,
    /// Per decoder layer (empty: no context parallelism): the all-to-alls of its forward, and
    /// of its backward with the replay's again. They run inside the layer's compute, which
    /// waits for each: the model puts them after it on their own lane, before the next compute.
    #[serde(default)]
    pub all_to_all_forward_s: Vec<f64>,
    #[serde(default)]
    pub all_to_all_backward_s: Vec<f64>,
    /// Per group (empty: one rank, one update lane): the rank whose update worker runs its
    /// AdamW and host sum (`runtime.dist`'s owner); each owner is an update lane of its own.
    #[serde(default)]
    pub owners: Vec<usize>,
    pub slots: usize,
    pub grad_slots: usize,
    pub clipping: bool,
}

fn blocks() -> bool {
    true
}

impl StepSpec {
    pub fn layers(&self) -> usize {
        self.forward_s.len()
    }

    /// Every per-group list has `L + 2` entries and every per-layer list `L` (offload lists
    /// may be empty: no offload); times are finite and not negative; a gradient ring slot.
    pub fn check(&self) -> Result<()> {
        let layers = self.layers();
        let per_layer = |list: &Vec<f64>| if list.is_empty() { 0 } else { layers };
        let lists: [(&str, &Vec<f64>, usize); 12] = [
            (
                "host_sum_s",
                &self.host_sum_s,
                if self.host_sum_s.is_empty() {
                    0
                } else {
                    layers + 2
                },
            ),
            (
                "reduce_s",
                &self.reduce_s,
                if self.reduce_s.is_empty() {
                    0
                } else {
                    layers + 2
                },
            ),
            (
                "cast_s",
                &self.cast_s,
                if self.cast_s.is_empty() {
                    0
                } else {
                    layers + 2
                },
            ),
            ("backward_s", &self.backward_s, layers),
            ("load_s", &self.load_s, layers + 2),
            ("grad_copy_s", &self.grad_copy_s, layers + 2),
            ("update_s", &self.update_s, layers + 2),
            (
                "offload_s",
                &self.offload_s,
                if self.offload_s.is_empty() { 0 } else { layers },
            ),
            (
                "reload_s",
                &self.reload_s,
                if self.reload_s.is_empty() { 0 } else { layers },
            ),
            ("forward_s", &self.forward_s, layers),
            (
                "all_to_all_forward_s",
                &self.all_to_all_forward_s,
                per_layer(&self.all_to_all_forward_s),
            ),
            (
                "all_to_all_backward_s",
                &self.all_to_all_backward_s,
                per_layer(&self.all_to_all_backward_s),
            ),
        ];
        for (name, list, want) in lists {
            if list.len() != want {
                return Err(Error::InvalidArgument(format!(
                    "step spec: {name} has {} entries, expected {want}",
                    list.len()
                )));
            }
        }
        let scalars = [self.embed_forward_s, self.head_s, self.embed_backward_s];
        let all = lists
            .iter()
            .flat_map(|(_, l, _)| l.iter())
            .chain(scalars.iter());
        for (name, len) in [
            ("resident", self.resident.len()),
            ("owners", self.owners.len()),
        ] {
            if len != 0 && len != layers + 2 {
                return Err(Error::InvalidArgument(format!(
                    "step spec: {name} has {len} entries, expected {}",
                    layers + 2
                )));
            }
        }
        if layers == 0 || self.grad_slots == 0 || all.clone().any(|x| !x.is_finite() || *x < 0.0) {
            return Err(Error::InvalidArgument(
                "step spec: needs a layer, a gradient slot, and finite times >= 0".into(),
            ));
        }
        Ok(())
    }

    pub(super) fn resident(&self, group: usize) -> bool {
        self.resident.get(group).copied().unwrap_or(false)
    }

    /// The update lane of `group`: its owner's.
    pub(super) fn update_lane(&self, group: usize) -> (Lane, usize) {
        (Lane::Update, self.owners.get(group).copied().unwrap_or(0))
    }

    /// The gradient ring `group`'s send goes into: its owner's on the gpu route (the owner
    /// alone sends it), this rank's (every group's) on the cpu route.
    pub(super) fn ring_of(&self, group: usize) -> usize {
        if self.host_sum_s.is_empty() {
            self.update_lane(group).1
        } else {
            0
        }
    }

    /// The D2H lane `group`'s gradient copy runs on: its sender's GPU, the owner's on the gpu
    /// route (each rank copies from its own device, the ranks in parallel), this rank's on the
    /// cpu route (every rank copies every group).
    pub(super) fn copy_lane(&self, group: usize) -> (Lane, usize) {
        (Lane::D2h, self.ring_of(group))
    }

    pub(super) fn host_sum(&self, group: usize) -> f64 {
        self.host_sum_s.get(group).copied().unwrap_or(0.0)
    }

    pub(super) fn cast(&self, group: usize) -> f64 {
        self.cast_s.get(group).copied().unwrap_or(0.0)
    }

    pub(super) fn offload(&self, layer: usize) -> f64 {
        self.offload_s.get(layer - 1).copied().unwrap_or(0.0)
    }

    pub(super) fn reload(&self, layer: usize) -> f64 {
        self.reload_s.get(layer - 1).copied().unwrap_or(0.0)
    }
}
