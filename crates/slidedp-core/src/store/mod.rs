//! The host state store: one authoritative copy of the training state for every process of the
//! machine.
//!
//! Memory map of the shared region (offsets in [`layout::RegionOffsets`]):
//!
//! ```text
//! [header 256 B][StoreSpec JSON][version counters, 64 B each][master f32][exp_avg f32]
//! [exp_avg_sq f32][grad slot 0 .. G-1, bf16|f32][staging slot 0 .. S-1, bf16]
//! ```
//!
//! The creator writes the header and the spec; an attaching process reads the spec back and
//! resolves the same layout, so the region describes itself. Ownership: the kernel owns the memory
//! (an anonymous tmpfs file, see [`shm`]); each `HostStore` owns one mapping of it and every
//! pointer it hands out is valid for as long as that `HostStore` lives.

pub mod layout;
pub mod shm;
pub mod versions;

use std::path::Path;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

pub use layout::{Dtype, GroupSpec, ParamSpec, StoreLayout, StoreSpec};
pub use shm::PartCount;
use shm::SharedRegion;
use versions::VersionGates;

use crate::error::{Error, Result};

const MAGIC: [u8; 8] = *b"SLIDEDP\0";
const FORMAT_VERSION: u32 = 1;
const HEADER_FIXED_BYTES: usize = 256;

/// The fixed part of the region's first bytes.
#[repr(C)]
struct Header {
    magic: [u8; 8],
    format_version: u32,
    /// Non-zero once a process declared the store failed (see [`VersionGates::poison`]).
    poison: AtomicU32,
    nonce: u64,
    total_bytes: u64,
    spec_json_len: u64,
}

/// The serialized spec (written after the header) and the layout that leaves room for both.
fn resolve_with_header(spec: &StoreSpec) -> Result<(Vec<u8>, StoreLayout)> {
    let spec_json = serde_json::to_vec(spec)
        .map_err(|e| Error::InvalidLayout(format!("cannot serialize the spec: {e}")))?;
    let layout = StoreLayout::resolve(spec, HEADER_FIXED_BYTES + spec_json.len())?;
    Ok((spec_json, layout))
}

/// The kinds of arrays in the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Region {
    Master,
    ExpAvg,
    ExpAvgSq,
    /// `grad_slots` gradient chunks in `grad_dtype` (the update lane's input ring).
    Grad,
    Staging,
    /// The BF16 copy of every parameter (empty without `bf16_mirror`).
    Mirror,
}

impl Region {
    pub fn parse(name: &str) -> Option<Region> {
        match name {
            "master" => Some(Region::Master),
            "exp_avg" => Some(Region::ExpAvg),
            "exp_avg_sq" => Some(Region::ExpAvgSq),
            "grad" => Some(Region::Grad),
            "staging" => Some(Region::Staging),
            "mirror" => Some(Region::Mirror),
            _ => None,
        }
    }
}

#[derive(Debug)]
pub struct HostStore {
    region: SharedRegion,
    layout: StoreLayout,
    name: String,
}

impl HostStore {
    /// Creates a zero-filled store for `spec` in `shm_dir` (normally `/dev/shm`), its memory
    /// filled by every core ([`PartCount::Auto`]).
    pub fn create(spec: &StoreSpec, shm_dir: &Path) -> Result<Self> {
        Self::create_in_parts(spec, shm_dir, PartCount::Auto)
    }

    /// [`HostStore::create`] from `parts` files, each filled by its own thread.
    pub fn create_in_parts(spec: &StoreSpec, shm_dir: &Path, parts: PartCount) -> Result<Self> {
        let (spec_json, layout) = resolve_with_header(spec)?;
        let region = SharedRegion::create(shm_dir, layout.regions.total_bytes, parts)?;
        let nonce = random_u64();
        // SAFETY: the region is at least `total_bytes` long, page-aligned, zero-filled and not yet
        // visible to any other process (nobody knows its name); the spec bytes fit by layout
        // construction (`versions` offset is past them).
        unsafe {
            let base = region.as_ptr();
            base.cast::<Header>().write(Header {
                magic: MAGIC,
                format_version: FORMAT_VERSION,
                poison: AtomicU32::new(0),
                nonce,
                total_bytes: layout.regions.total_bytes as u64,
                spec_json_len: spec_json.len() as u64,
            });
            std::ptr::copy_nonoverlapping(
                spec_json.as_ptr(),
                base.add(HEADER_FIXED_BYTES),
                spec_json.len(),
            );
        }
        let fds: Vec<String> = region.raw_fds().iter().map(i32::to_string).collect();
        let name = format!(
            "slidedp-{}-{}-{nonce:016x}",
            std::process::id(),
            fds.join(".")
        );
        Ok(Self {
            region,
            layout,
            name,
        })
    }

    /// The layout (`regions.total_bytes` included) that `create` would give `spec`, computed
    /// without allocating anything.
    pub fn plan(spec: &StoreSpec) -> Result<StoreLayout> {
        Ok(resolve_with_header(spec)?.1)
    }

    /// Attaches to a store created by another (living) process, by the name it reported.
    pub fn attach(name: &str) -> Result<Self> {
        let bad = |reason: &str| Error::StoreAttach {
            name: name.to_owned(),
            reason: reason.to_owned(),
        };
        let form = "expected a name of the form slidedp-PID-FD[.FD...]-NONCE";
        let parts: Vec<&str> = name.split('-').collect();
        let [prefix, pid, fds, nonce] = parts.as_slice() else {
            return Err(bad(form));
        };
        let fds: std::result::Result<Vec<i32>, _> = fds.split('.').map(str::parse).collect();
        let (Ok(pid), Ok(fds), Ok(nonce)) =
            (pid.parse::<u32>(), fds, u64::from_str_radix(nonce, 16))
        else {
            return Err(bad(form));
        };
        if *prefix != "slidedp" {
            return Err(bad(form));
        }
        let region = SharedRegion::attach(pid, &fds).map_err(|e| bad(&e.to_string()))?;
        if region.len_bytes() < HEADER_FIXED_BYTES {
            return Err(bad("the file is too small to be a store"));
        }
        // SAFETY: the mapping holds at least the fixed header; Header is plain data plus an
        // atomic, and the creator finished writing it before publishing the name.
        let header = unsafe { &*region.as_ptr().cast::<Header>() };
        if header.magic != MAGIC || header.nonce != nonce {
            return Err(bad(
                "that descriptor is not this store (the process reused it?)",
            ));
        }
        if header.format_version != FORMAT_VERSION {
            return Err(bad(&format!(
                "store format {} but this build reads format {FORMAT_VERSION}",
                header.format_version
            )));
        }
        let spec_len = header.spec_json_len as usize;
        if header.total_bytes as usize != region.len_bytes()
            || HEADER_FIXED_BYTES + spec_len > region.len_bytes()
        {
            return Err(bad("the store's header is inconsistent with its size"));
        }
        // SAFETY: bounds checked just above; the creator wrote these bytes before naming the store.
        let spec_json = unsafe {
            std::slice::from_raw_parts(region.as_ptr().add(HEADER_FIXED_BYTES), spec_len)
        };
        let spec: StoreSpec = serde_json::from_slice(spec_json)
            .map_err(|e| bad(&format!("unreadable layout: {e}")))?;
        let layout = StoreLayout::resolve(&spec, HEADER_FIXED_BYTES + spec_len)?;
        if layout.regions.total_bytes != region.len_bytes() {
            return Err(bad("the layout does not match the store's size"));
        }
        Ok(Self {
            region,
            layout,
            name: name.to_owned(),
        })
    }

    /// The name other processes pass to [`HostStore::attach`].
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn layout(&self) -> &StoreLayout {
        &self.layout
    }

    pub fn total_bytes(&self) -> usize {
        self.region.len_bytes()
    }

    pub fn base_ptr(&self) -> *mut u8 {
        self.region.as_ptr()
    }

    /// Start address and byte length of one region; valid while `self` lives.
    pub fn region(&self, region: Region) -> (*mut u8, usize) {
        let r = &self.layout.regions;
        let (state_bytes, moment_bytes) = (self.layout.state_len * 4, self.layout.moment_len * 4);
        let (offset, len) = match region {
            Region::Master => (r.master, state_bytes),
            Region::ExpAvg => (r.exp_avg, moment_bytes),
            Region::ExpAvgSq => (r.exp_avg_sq, moment_bytes),
            Region::Grad => (
                r.grad,
                self.layout.grad_slots * self.layout.grad_slot_bytes(),
            ),
            Region::Staging => (
                r.staging,
                self.layout.staging_slots * self.layout.slot_len * 2,
            ),
            Region::Mirror => (r.mirror, self.layout.mirror_len * 2),
        };
        // SAFETY: offset + len <= total_bytes by layout construction, so the result stays inside
        // the mapping.
        (unsafe { self.base_ptr().add(offset) }, len)
    }

    /// The per-layer version gates, borrowed from this mapping.
    pub fn gates(&self) -> VersionGates<'_> {
        let base = self.base_ptr();
        let versions = self.layout.regions.versions;
        let counters = (0..self.layout.groups.len())
            .map(|i| {
                // SAFETY: counter i lies inside the versions region (layout construction), is
                // 64-byte aligned, and lives as long as the mapping borrowed by `&self`.
                unsafe {
                    &*base
                        .add(versions + i * layout::VERSION_STRIDE_BYTES)
                        .cast::<AtomicU32>()
                }
            })
            .collect();
        VersionGates::new(counters, &self.header().poison)
    }

    pub fn publish(&self, layer: usize, version: u32) -> Result<()> {
        self.gates().publish(layer, version)
    }

    pub fn wait_version(&self, layer: usize, version: u32, timeout: Duration) -> Result<u32> {
        self.gates().wait(layer, version, timeout)
    }

    pub fn version(&self, layer: usize) -> Result<u32> {
        self.gates().get(layer)
    }

    /// See [`VersionGates::poison`]: with `claim`, true for the store's first claimed
    /// failure, in any process.
    pub fn poison(&self, claim: bool) -> bool {
        self.gates().poison(claim)
    }

    fn header(&self) -> &Header {
        // SAFETY: the header was validated (create wrote it, attach checked it) and lives as long
        // as the mapping borrowed by `&self`.
        unsafe { &*self.base_ptr().cast::<Header>() }
    }
}

/// A random 64-bit value from the kernel (used for store nonces and fallback file names).
pub(crate) fn random_u64() -> u64 {
    let mut value = 0u64;
    // SAFETY: getrandom writes at most 8 bytes into `value`.
    let n = unsafe { libc::getrandom((&raw mut value).cast(), 8, 0) };
    if n == 8 {
        value
    } else {
        // Entropy is only needed to tell stores apart; time and pid suffice as a fallback.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t ^ (u64::from(std::process::id()) << 32)
    }
}

#[cfg(test)]
mod tests;
