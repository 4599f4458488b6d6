//! Where every parameter lives in the store.
//!
//! The store holds FP32 master weights of every parameter, the two Adam moments (`exp_avg`,
//! `exp_avg_sq`) of the trained ones only, `staging_slots` BF16 staging slots and `grad_slots`
//! gradient slots. Parameters are grouped (one group per decoder layer, plus groups for
//! embeddings and head); a group's parameters are contiguous so that one layer is one range of
//! each array, and every parameter starts on a 64-byte boundary in both the FP32 arrays and the
//! BF16 slot layout. Inside a group the trained parameters come first (spec order otherwise), so
//! they are the first `trained_len` elements of its master range and a moment range of the
//! same length: a frozen parameter gets no moments, no gradient and no update.
//!
//! Transfers move *chunks* of at most `slot_len` elements: a staging chunk is a range of a
//! group's slot layout (params at their `slot_offset`), a gradient chunk is a range of the
//! group's state layout (params at `state_offset - group.state_offset`). By default a slot holds
//! the largest group whole, so a layer is one contiguous transfer; a smaller `chunk_elems` splits
//! big groups (embeddings, LM head) — host memory for slots is then bounded by the chunk, not by
//! the vocabulary.
//!
//! With `bf16_mirror`, the store also holds a BF16 copy of every parameter in the slot layout,
//! group after group (`mirror_offset`): the update worker writes it as AdamW's by-product, so a
//! layer is delivered by one DMA from the mirror, with no cast on the load path (2 bytes per
//! parameter more host memory).

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Every parameter and every region starts on a cache line.
pub const ALIGN_BYTES: usize = 64;
const F32_ALIGN_ELEMS: usize = ALIGN_BYTES / 4;
const BF16_ALIGN_ELEMS: usize = ALIGN_BYTES / 2;

/// The dtype a parameter is delivered to the GPU in (its master copy is always FP32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Bf16,
    F32,
}

impl Dtype {
    pub fn size_bytes(self) -> usize {
        match self {
            Dtype::Bf16 => 2,
            Dtype::F32 => 4,
        }
    }
}

/// One named tensor of the model, as the caller describes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: Dtype,
    /// Never updated: no Adam moments, no gradient (its master weights stay as loaded).
    #[serde(default)]
    pub frozen: bool,
}

/// A named group of parameters updated and versioned together (a decoder layer, say).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupSpec {
    pub name: String,
    pub params: Vec<ParamSpec>,
}

/// What the caller asks the store to hold (`slidedp.store.StoreSpec`). It and its parts refuse
/// unknown fields: a field misnamed on either side of the JSON seam is an error, not a default.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreSpec {
    pub groups: Vec<GroupSpec>,
    /// Number of BF16 staging slots of `chunk_elems` elements each.
    pub staging_slots: usize,
    /// Elements of a staging slot and of a gradient slot; None: the largest group fits whole.
    #[serde(default)]
    pub chunk_elems: Option<usize>,
    /// Number of gradient slots of `chunk_elems` elements in `grad_dtype` (the update lane's input
    /// ring); 0: no gradient region.
    #[serde(default)]
    pub grad_slots: usize,
    /// Dtype of the gradient slots (required when `grad_slots > 0`).
    #[serde(default)]
    pub grad_dtype: Option<Dtype>,
    /// Hold a BF16 copy of every parameter (the `mirror` region).
    #[serde(default)]
    pub bf16_mirror: bool,
}

/// A parameter's resolved place.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamLayout {
    pub name: String,
    pub group: usize,
    pub shape: Vec<usize>,
    pub dtype: Dtype,
    pub numel: usize,
    pub frozen: bool,
    /// Element offset into the master weights.
    pub state_offset: usize,
    /// Element offset into each Adam moment array (None: frozen, no moments).
    pub moment_offset: Option<usize>,
    /// Element offset into a BF16 staging slot, relative to the slot's start.
    pub slot_offset: usize,
}

/// A group's resolved place: `params` indexes [`StoreLayout::params`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupLayout {
    pub name: String,
    pub params: std::ops::Range<usize>,
    /// Element range in the master weights, padding included (padding stays zero).
    pub state_offset: usize,
    pub state_len: usize,
    /// The trained parameters' part of that range (its first elements): the range of the
    /// group's gradient and of its moments, which start at `moment_offset`.
    pub trained_len: usize,
    pub moment_offset: usize,
    /// Elements of a staging slot this group occupies, padding included.
    pub slot_len: usize,
    /// Element offset of the group's slot layout in the BF16 mirror (when the store has one).
    pub mirror_offset: usize,
}

/// Byte offsets of the regions inside the shared mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionOffsets {
    pub versions: usize,
    pub master: usize,
    pub exp_avg: usize,
    pub exp_avg_sq: usize,
    pub grad: usize,
    pub staging: usize,
    /// The BF16 mirror (`mirror_len` elements; none without `bf16_mirror`).
    pub mirror: usize,
    pub total_bytes: usize,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreLayout {
    pub groups: Vec<GroupLayout>,
    pub params: Vec<ParamLayout>,
    /// Elements of the master weights.
    pub state_len: usize,
    /// Elements of each Adam moment array (the trained parameters', padding included).
    pub moment_len: usize,
    /// Elements in one staging slot and in one gradient slot (the chunk size).
    pub slot_len: usize,
    pub staging_slots: usize,
    pub grad_slots: usize,
    pub grad_dtype: Option<Dtype>,
    /// Elements of the BF16 mirror (0 without one): every group's `slot_len`, back to back.
    pub mirror_len: usize,
    pub regions: RegionOffsets,
}

/// Each version counter sits on its own cache line so that publishing one layer does not
/// invalidate the line another rank is polling.
pub const VERSION_STRIDE_BYTES: usize = ALIGN_BYTES;

pub fn align_up(value: usize, align: usize) -> usize {
    value.div_ceil(align) * align
}

impl StoreLayout {
    /// Resolves `spec`; `header_bytes` is the space reserved at the start for the header and the
    /// serialized layout.
    pub fn resolve(spec: &StoreSpec, header_bytes: usize) -> Result<Self> {
        validate(spec)?;
        let mut groups = Vec::with_capacity(spec.groups.len());
        let mut params = Vec::new();
        let mut state_cursor = 0usize;
        let mut moment_cursor = 0usize;
        let mut mirror_cursor = 0usize;
        for (group_index, group) in spec.groups.iter().enumerate() {
            let first_param = params.len();
            let group_start = state_cursor;
            let mut slot_cursor = 0usize;
            let mut trained_len = 0usize;
            // trained parameters first: their gradient and moments are one prefix of the group
            let trained = group.params.iter().filter(|p| !p.frozen);
            for param in trained.chain(group.params.iter().filter(|p| p.frozen)) {
                let numel: usize = param.shape.iter().product();
                let relative = state_cursor - group_start;
                params.push(ParamLayout {
                    name: param.name.clone(),
                    group: group_index,
                    shape: param.shape.clone(),
                    dtype: param.dtype,
                    numel,
                    frozen: param.frozen,
                    state_offset: state_cursor,
                    moment_offset: (!param.frozen).then_some(moment_cursor + relative),
                    slot_offset: slot_cursor,
                });
                state_cursor = align_up(state_cursor + numel, F32_ALIGN_ELEMS);
                slot_cursor = align_up(slot_cursor + numel, BF16_ALIGN_ELEMS);
                if !param.frozen {
                    trained_len = state_cursor - group_start;
                }
            }
            groups.push(GroupLayout {
                name: group.name.clone(),
                params: first_param..params.len(),
                state_offset: group_start,
                state_len: state_cursor - group_start,
                trained_len,
                moment_offset: moment_cursor,
                slot_len: slot_cursor,
                mirror_offset: mirror_cursor,
            });
            moment_cursor += trained_len;
            mirror_cursor += slot_cursor; // a multiple of the BF16 alignment already
        }
        let mirror_len = if spec.bf16_mirror { mirror_cursor } else { 0 };
        let whole_group = groups
            .iter()
            .map(|g| g.slot_len.max(g.state_len))
            .max()
            .unwrap_or(0);
        let slot_len = align_up(spec.chunk_elems.unwrap_or(whole_group), BF16_ALIGN_ELEMS);
        let versions = align_up(header_bytes, ALIGN_BYTES);
        let master = align_up(versions + groups.len() * VERSION_STRIDE_BYTES, 4096);
        let (state_bytes, moment_bytes) = (state_cursor * 4, moment_cursor * 4);
        let exp_avg = master + state_bytes;
        let exp_avg_sq = exp_avg + moment_bytes;
        let grad = exp_avg_sq + moment_bytes;
        let grad_bytes = spec
            .grad_dtype
            .map_or(0, |d| d.size_bytes() * slot_len * spec.grad_slots);
        let staging = align_up(grad + grad_bytes, ALIGN_BYTES);
        let mirror = align_up(staging + spec.staging_slots * slot_len * 2, 4096);
        let total_bytes = align_up(mirror + mirror_len * 2, 4096);
        Ok(Self {
            groups,
            params,
            state_len: state_cursor,
            moment_len: moment_cursor,
            slot_len,
            staging_slots: spec.staging_slots,
            grad_slots: spec.grad_slots,
            grad_dtype: spec.grad_dtype,
            mirror_len,
            regions: RegionOffsets {
                versions,
                master,
                exp_avg,
                exp_avg_sq,
                grad,
                staging,
                mirror,
                total_bytes,
            },
        })
    }

    pub fn param(&self, name: &str) -> Result<&ParamLayout> {
        self.params
            .iter()
            .find(|p| p.name == name)
            .ok_or_else(|| Error::UnknownParameter {
                name: name.to_owned(),
            })
    }

    pub fn group(&self, index: usize) -> Result<&GroupLayout> {
        self.groups.get(index).ok_or(Error::LayerOutOfRange {
            layer: index,
            layers: self.groups.len(),
        })
    }

    /// Bytes of one gradient slot (0 without a gradient region).
    pub fn grad_slot_bytes(&self) -> usize {
        self.grad_dtype
            .map_or(0, |d| d.size_bytes() * self.slot_len)
    }

    /// Number of real (unpadded) parameters.
    pub fn numel(&self) -> usize {
        self.params.iter().map(|p| p.numel).sum()
    }
}

fn validate(spec: &StoreSpec) -> Result<()> {
    if spec.grad_slots > 0 && spec.grad_dtype.is_none() {
        return Err(Error::InvalidLayout(
            "grad_slots > 0 needs a grad_dtype".into(),
        ));
    }
    if spec.chunk_elems == Some(0) {
        return Err(Error::InvalidLayout("chunk_elems must be > 0".into()));
    }
    if spec.groups.is_empty() {
        return Err(Error::InvalidLayout(
            "the store needs at least one group".into(),
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for group in &spec.groups {
        if group.params.is_empty() {
            return Err(Error::InvalidLayout(format!(
                "group '{}' has no parameters",
                group.name
            )));
        }
        for param in &group.params {
            if !seen.insert(param.name.as_str()) {
                return Err(Error::InvalidLayout(format!(
                    "parameter '{}' appears twice",
                    param.name
                )));
            }
            if param.shape.contains(&0) {
                return Err(Error::InvalidLayout(format!(
                    "parameter '{}' has an empty shape {:?}",
                    param.name, param.shape
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> StoreSpec {
        let p = |name: &str, shape: &[usize]| ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            dtype: Dtype::Bf16,
            frozen: false,
        };
        StoreSpec {
            groups: vec![
                GroupSpec {
                    name: "embed".into(),
                    params: vec![p("embed.weight", &[10, 7])],
                },
                GroupSpec {
                    name: "layers.0".into(),
                    params: vec![p("layers.0.w", &[3, 5]), p("layers.0.norm", &[5])],
                },
            ],
            staging_slots: 2,
            chunk_elems: None,
            grad_slots: 3,
            grad_dtype: Some(Dtype::Bf16),
            bf16_mirror: false,
        }
    }

    #[test]
    fn params_are_cache_line_aligned_and_groups_contiguous() {
        let layout = StoreLayout::resolve(&spec(), 4096).unwrap();
        for p in &layout.params {
            assert_eq!(p.state_offset * 4 % ALIGN_BYTES, 0, "{}", p.name);
            assert_eq!(p.slot_offset * 2 % ALIGN_BYTES, 0, "{}", p.name);
        }
        let g1 = &layout.groups[1];
        assert_eq!(g1.state_offset, layout.groups[0].state_len);
        assert_eq!(layout.param("layers.0.norm").unwrap().state_offset, 80 + 16);
        assert_eq!(g1.state_len, 16 + 16);
        assert_eq!(layout.slot_len, 96);
        assert_eq!(layout.numel(), 70 + 15 + 5);
        let r = layout.regions;
        assert!(r.versions >= 4096 && r.master.is_multiple_of(4096));
        assert_eq!(r.exp_avg - r.master, layout.state_len * 4);
        assert_eq!(r.total_bytes % 4096, 0);
        assert_eq!(r.grad - r.exp_avg_sq, layout.state_len * 4);
        assert!(
            r.staging >= r.grad + 3 * 96 * 2,
            "three bf16 gradient slots"
        );
        assert!(r.total_bytes >= r.staging + 2 * 96 * 2);
    }

    #[test]
    fn frozen_params_come_last_and_get_no_moments() {
        let mut s = spec();
        s.groups[1].params[0].frozen = true; // layers.0.w: its norm moves before it
        s.groups.push(GroupSpec {
            name: "head".into(),
            params: vec![ParamSpec {
                name: "head.w".into(),
                shape: vec![4],
                dtype: Dtype::F32,
                frozen: true,
            }],
        });
        let layout = StoreLayout::resolve(&s, 4096).unwrap();
        let (norm, w) = (&layout.params[1], &layout.params[2]);
        assert_eq!(
            (norm.name.as_str(), w.name.as_str()),
            ("layers.0.norm", "layers.0.w")
        );
        assert_eq!(norm.state_offset, 80);
        assert_eq!(w.state_offset, 96);
        assert_eq!((norm.moment_offset, w.moment_offset), (Some(80), None));
        let (g1, g2) = (&layout.groups[1], &layout.groups[2]);
        assert_eq!(
            (g1.trained_len, g1.state_len, g1.moment_offset),
            (16, 32, 80)
        );
        assert_eq!((g2.trained_len, g2.moment_offset), (0, 96));
        assert_eq!(layout.moment_len, 80 + 16);
        assert_eq!(layout.state_len, 80 + 32 + 16);
        let r = layout.regions;
        assert_eq!(r.exp_avg - r.master, layout.state_len * 4);
        assert_eq!(r.exp_avg_sq - r.exp_avg, layout.moment_len * 4);
        assert_eq!(r.grad - r.exp_avg_sq, layout.moment_len * 4);
    }

    #[test]
    fn chunk_elems_bounds_the_slots_not_the_groups() {
        let mut s = spec();
        s.chunk_elems = Some(40);
        let layout = StoreLayout::resolve(&s, 4096).unwrap();
        assert_eq!(layout.slot_len, 64, "rounded up to a cache line of bf16");
        assert_eq!(layout.grad_slot_bytes(), 128);
        let r = layout.regions;
        assert_eq!(r.staging - r.grad, 3 * 128);
        s.grad_dtype = None;
        assert!(matches!(
            StoreLayout::resolve(&s, 0),
            Err(Error::InvalidLayout(_))
        ));
    }

    #[test]
    fn rejects_duplicates_and_empty_shapes() {
        let mut s = spec();
        s.groups[1].params[1].name = "embed.weight".into();
        assert!(matches!(
            StoreLayout::resolve(&s, 0),
            Err(Error::InvalidLayout(_))
        ));
        let mut s = spec();
        s.groups[0].params[0].shape = vec![4, 0];
        assert!(matches!(
            StoreLayout::resolve(&s, 0),
            Err(Error::InvalidLayout(_))
        ));
        assert!(matches!(
            StoreLayout::resolve(
                &StoreSpec {
                    groups: vec![],
                    staging_slots: 1,
                    chunk_elems: None,
                    grad_slots: 0,
                    grad_dtype: None,
                    bf16_mirror: false,
                },
                0
            ),
            Err(Error::InvalidLayout(_))
        ));
    }

    #[test]
    fn unknown_names_and_groups_are_typed_errors() {
        let layout = StoreLayout::resolve(&spec(), 0).unwrap();
        assert!(matches!(
            layout.param("nope"),
            Err(Error::UnknownParameter { .. })
        ));
        assert!(matches!(
            layout.group(5),
            Err(Error::LayerOutOfRange {
                layer: 5,
                layers: 2
            })
        ));
    }
}
