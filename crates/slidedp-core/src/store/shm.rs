//! A shared-memory region that has no name in the file system.
//!
//! The creator opens K anonymous tmpfs files ("parts") in the shm directory (`O_TMPFILE`, so there
//! is never a directory entry to leak, not even for an instant), preallocates each with
//! `fallocate` on its own thread (tmpfs zero-fills a file under its inode lock, so one file fills
//! on one core; K files fill on K), so that a shortage is an error here rather than a SIGBUS later,
//! and maps the parts back to back in one reserved address range. Other processes attach through
//! the creator's descriptors, `/proc/<pid>/fd/<fd>`: the region's name encodes pid, the parts' fds
//! and a random nonce that is also written into the region and checked on attach. The kernel frees
//! the memory when the last process holding a descriptor or a mapping exits, crashes included.
//! The one constraint: the creator must be alive while others attach (rank 0 outlives the job).

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;

use crate::error::{Error, Result};

/// The smallest part that `PartCount::Auto` makes: below it a thread costs more than it fills.
const AUTO_MIN_PART_BYTES: usize = 1 << 30;
/// Parts start on 2 MiB boundaries where they are that large (tmpfs may back them with huge pages).
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// How many part files a region is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartCount {
    /// One part per core, each at least 1 GiB (one part for a region under 2 GiB).
    Auto,
    /// At most this many parts (fewer where the region has fewer pages).
    Exactly(usize),
}

/// One mapping of the region in this process. Owns the parts' descriptors and the mapping; both
/// are released on drop (the memory itself lives until the last process lets go).
#[derive(Debug)]
pub struct SharedRegion {
    parts: Vec<File>,
    ptr: *mut u8,
    len_bytes: usize,
}

// SAFETY: the mapping is plain shared memory valid until drop; concurrent access to its contents
// is coordinated by the store's version gates and atomics, not by this handle.
unsafe impl Send for SharedRegion {}
// SAFETY: as above; `&SharedRegion` only hands out the base pointer and the length.
unsafe impl Sync for SharedRegion {}

impl SharedRegion {
    /// Creates a zero-filled region of `len_bytes` in `dir` (normally `/dev/shm`) from `parts`
    /// files filled in parallel, failing with [`Error::OutOfSharedMemory`] when `dir` or the host's
    /// RAM cannot hold it (every part made so far is closed, so nothing is left behind).
    pub fn create(dir: &Path, len_bytes: usize, parts: PartCount) -> Result<Self> {
        if len_bytes == 0 {
            return Err(Error::InvalidArgument(
                "a shared region cannot be empty".into(),
            ));
        }
        check_space(dir, len_bytes as u64)?;
        let lens = part_lens(len_bytes, parts);
        let files: Vec<Result<File>> = std::thread::scope(|scope| {
            let fills: Vec<_> = lens
                .iter()
                .map(|&len| scope.spawn(move || allocated_file(dir, len)))
                .collect();
            fills
                .into_iter()
                .map(|fill| fill.join().expect("a part's fill thread panicked"))
                .collect()
        });
        let files: Vec<File> = files
            .into_iter()
            .collect::<Result<_>>()
            .map_err(|e| match e {
                Error::OutOfSharedMemory { .. } => Error::OutOfSharedMemory {
                    path: dir.display().to_string(),
                    needed_bytes: len_bytes as u64,
                    available_bytes: available_bytes(dir).unwrap_or(0),
                },
                other => other,
            })?;
        Self::map(files, &lens)
    }

    /// Attaches to the region whose parts process `pid` holds open as descriptors `fds`, in order.
    pub fn attach(pid: u32, fds: &[i32]) -> Result<Self> {
        let mut files = Vec::with_capacity(fds.len());
        let mut lens = Vec::with_capacity(fds.len());
        for fd in fds {
            let path = format!("/proc/{pid}/fd/{fd}");
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| {
                    Error::io(format!("open {path} (is process {pid} still alive?)"), e)
                })?;
            let len = file
                .metadata()
                .map_err(|e| Error::io(format!("stat {path}"), e))?
                .len() as usize;
            files.push(file);
            lens.push(len);
        }
        let page = page_bytes();
        let (last, inner) = lens.split_last().ok_or_else(|| {
            Error::InvalidArgument("a shared region has at least one part".into())
        })?;
        if *last == 0
            || inner
                .iter()
                .any(|&len| len == 0 || !len.is_multiple_of(page))
        {
            return Err(Error::InvalidArgument(
                "the parts are not a region's (empty, or not whole pages)".into(),
            ));
        }
        Self::map(files, &lens)
    }

    /// Reserves one address range for the whole region and maps each part into it, in order.
    fn map(parts: Vec<File>, lens: &[usize]) -> Result<Self> {
        let len_bytes: usize = lens.iter().sum();
        // SAFETY: an anonymous, inaccessible reservation at an address the kernel chooses; it
        // touches no existing mapping.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_bytes,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::io(
                format!("reserve {len_bytes} bytes of address space"),
                io::Error::last_os_error(),
            ));
        }
        // From here Drop unmaps the whole range (the reservation and every part mapped over it).
        let region = Self {
            parts,
            ptr: base.cast(),
            len_bytes,
        };
        let mut offset = 0;
        for (file, &len) in region.parts.iter().zip(lens) {
            // SAFETY: `base + offset .. + len` lies inside our own reservation (the lens sum to
            // its length; every part but the last is whole pages, so `offset` is page-aligned);
            // MAP_FIXED replaces only that reserved range with the part's shared pages.
            let at = unsafe {
                libc::mmap(
                    base.cast::<u8>().add(offset).cast(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    file.as_raw_fd(),
                    0,
                )
            };
            if at == libc::MAP_FAILED {
                return Err(Error::io(
                    format!("mmap a part of {len} bytes"),
                    io::Error::last_os_error(),
                ));
            }
            offset += len;
        }
        Ok(region)
    }

    /// The parts' descriptors, in address order, that other processes reopen through
    /// `/proc/<pid>/fd/<fd>`.
    pub fn raw_fds(&self) -> Vec<i32> {
        self.parts.iter().map(AsRawFd::as_raw_fd).collect()
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len_bytes` are exactly the reservation mmap returned (the parts are mapped
        // inside it) and nothing unmapped it yet.
        unsafe { libc::munmap(self.ptr.cast(), self.len_bytes) };
    }
}

/// The parts' byte lengths for a region of `len_bytes`: equal parts of whole pages (of whole
/// 2 MiB where that large) and a shorter last one, summing to `len_bytes`.
pub(super) fn part_lens(len_bytes: usize, parts: PartCount) -> Vec<usize> {
    let wanted = match parts {
        PartCount::Auto => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            cores.min(len_bytes / AUTO_MIN_PART_BYTES).max(1)
        }
        PartCount::Exactly(k) => k.max(1),
    };
    let mut part = len_bytes.div_ceil(wanted).next_multiple_of(page_bytes());
    if part >= HUGE_PAGE_BYTES {
        part = part.next_multiple_of(HUGE_PAGE_BYTES);
    }
    let mut lens = vec![part; len_bytes / part];
    if !len_bytes.is_multiple_of(part) {
        lens.push(len_bytes % part);
    }
    lens
}

/// The system's page size in bytes.
pub(crate) fn page_bytes() -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(page).unwrap_or(4096)
}

/// A nameless tmpfs file in `dir` of `len_bytes`, every page allocated (and zeroed) now.
fn allocated_file(dir: &Path, len_bytes: usize) -> Result<File> {
    let file = open_anonymous(dir)?;
    loop {
        // SAFETY: `file` is an open descriptor we own; fallocate only touches its extent.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len_bytes as libc::off_t) };
        if rc == 0 {
            return Ok(file);
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            // a signal interrupted the fill; the pages already allocated stay, the rest follow
            Some(libc::EINTR) => continue,
            Some(libc::ENOSPC) | Some(libc::ENOMEM) => {
                return Err(Error::OutOfSharedMemory {
                    path: dir.display().to_string(),
                    needed_bytes: len_bytes as u64,
                    available_bytes: available_bytes(dir).unwrap_or(0),
                });
            }
            _ => {
                return Err(Error::io(
                    format!("fallocate {len_bytes} bytes in {}", dir.display()),
                    err,
                ));
            }
        }
    }
}

/// Opens a nameless read-write tmpfs file in `dir`; falls back to create-then-unlink where
/// `O_TMPFILE` is unsupported (the name then exists for a few microseconds).
fn open_anonymous(dir: &Path) -> Result<File> {
    let c_dir = CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::InvalidArgument(format!("bad directory {}", dir.display())))?;
    let flags = libc::O_TMPFILE | libc::O_RDWR | libc::O_CLOEXEC;
    // SAFETY: `c_dir` is a valid NUL-terminated path; open returns a new descriptor or -1.
    let fd = unsafe { libc::open(c_dir.as_ptr(), flags, 0o600) };
    if fd >= 0 {
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        return Ok(unsafe { File::from_raw_fd(fd) });
    }
    let err = io::Error::last_os_error();
    if !matches!(
        err.raw_os_error(),
        Some(libc::EOPNOTSUPP) | Some(libc::EISDIR) | Some(libc::EINVAL)
    ) {
        return Err(Error::io(
            format!("create a store file in {}", dir.display()),
            err,
        ));
    }
    let path = dir.join(format!(
        "slidedp-{}-{:016x}",
        std::process::id(),
        super::random_u64()
    ));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| Error::io(format!("create {}", path.display()), e))?;
    std::fs::remove_file(&path).map_err(|e| Error::io(format!("unlink {}", path.display()), e))?;
    Ok(file)
}

/// Fails early, with both numbers, when `dir` or the host's available RAM is smaller than needed.
fn check_space(dir: &Path, needed_bytes: u64) -> Result<()> {
    let fs_available = available_bytes(dir)?;
    if needed_bytes > fs_available {
        return Err(Error::OutOfSharedMemory {
            path: dir.display().to_string(),
            needed_bytes,
            available_bytes: fs_available,
        });
    }
    if let Some(ram_available) = mem_available_bytes()
        && needed_bytes > ram_available
    {
        return Err(Error::OutOfSharedMemory {
            path: "host RAM (MemAvailable)".into(),
            needed_bytes,
            available_bytes: ram_available,
        });
    }
    Ok(())
}

/// Free bytes of the file system holding `dir`, as an unprivileged user may use them.
pub fn available_bytes(dir: &Path) -> Result<u64> {
    let c_dir = CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::InvalidArgument(format!("bad directory {}", dir.display())))?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c_dir` is NUL-terminated and `stat` is writable storage for one statvfs.
    let rc = unsafe { libc::statvfs(c_dir.as_ptr(), stat.as_mut_ptr()) };
    if rc != 0 {
        return Err(Error::io(
            format!("statvfs {} (does the directory exist?)", dir.display()),
            io::Error::last_os_error(),
        ));
    }
    // SAFETY: statvfs returned 0, so it filled the struct.
    let stat = unsafe { stat.assume_init() };
    Ok(stat.f_bavail * stat.f_frsize)
}

/// `MemAvailable` from /proc/meminfo, in bytes; None where the file is absent.
fn mem_available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
