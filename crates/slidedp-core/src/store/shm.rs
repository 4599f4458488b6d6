//! A shared-memory region that has no name in the file system.
//!
//! The creator opens an anonymous tmpfs file in the shm directory (`O_TMPFILE`, so there is never
//! a directory entry to leak, not even for an instant), preallocates it with `fallocate` so that a
//! shortage is an error here rather than a SIGBUS later, and maps it. Other processes attach
//! through the creator's descriptor, `/proc/<pid>/fd/<fd>`: the region's name encodes pid, fd and
//! a random nonce that is also written into the region and checked on attach. The kernel frees
//! the memory when the last process holding a descriptor or a mapping exits, crashes included.
//! The one constraint: the creator must be alive while others attach (rank 0 outlives the job).

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;

use crate::error::{Error, Result};

/// One mapping of the region in this process. Owns the descriptor and the mapping; both are
/// released on drop (the memory itself lives until the last process lets go).
#[derive(Debug)]
pub struct SharedRegion {
    file: File,
    ptr: *mut u8,
    len_bytes: usize,
}

// SAFETY: the mapping is plain shared memory valid until drop; concurrent access to its contents
// is coordinated by the store's version gates and atomics, not by this handle.
unsafe impl Send for SharedRegion {}
// SAFETY: as above; `&SharedRegion` only hands out the base pointer and the length.
unsafe impl Sync for SharedRegion {}

impl SharedRegion {
    /// Creates a zero-filled region of `len_bytes` in `dir` (normally `/dev/shm`), failing with
    /// [`Error::OutOfSharedMemory`] when `dir` or the host's RAM cannot hold it.
    pub fn create(dir: &Path, len_bytes: usize) -> Result<Self> {
        check_space(dir, len_bytes as u64)?;
        let file = open_anonymous(dir)?;
        // SAFETY: `file` is an open descriptor we own; fallocate only touches its extent.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len_bytes as libc::off_t) };
        if rc != 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENOSPC) || err.raw_os_error() == Some(libc::ENOMEM)
            {
                return Err(Error::OutOfSharedMemory {
                    path: dir.display().to_string(),
                    needed_bytes: len_bytes as u64,
                    available_bytes: available_bytes(dir).unwrap_or(0),
                });
            }
            return Err(Error::io(
                format!("fallocate {len_bytes} bytes in {}", dir.display()),
                err,
            ));
        }
        Self::map(file, len_bytes)
    }

    /// Attaches to the region that process `pid` holds open as descriptor `fd`.
    pub fn attach(pid: u32, fd: i32) -> Result<Self> {
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::io(format!("open {path} (is process {pid} still alive?)"), e))?;
        let len_bytes = file
            .metadata()
            .map_err(|e| Error::io(format!("stat {path}"), e))?
            .len() as usize;
        Self::map(file, len_bytes)
    }

    fn map(file: File, len_bytes: usize) -> Result<Self> {
        if len_bytes == 0 {
            return Err(Error::InvalidArgument(
                "a shared region cannot be empty".into(),
            ));
        }
        // SAFETY: a fresh shared mapping of an fd we own, with the length of the file; the kernel
        // chooses the address. The mapping is unmapped exactly once, in Drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::io(
                format!("mmap {len_bytes} bytes"),
                io::Error::last_os_error(),
            ));
        }
        Ok(Self {
            file,
            ptr: ptr.cast(),
            len_bytes,
        })
    }

    /// The descriptor other processes reopen through `/proc/<pid>/fd/<fd>`.
    pub fn raw_fd(&self) -> i32 {
        self.file.as_raw_fd()
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
        // SAFETY: `ptr`/`len_bytes` are exactly what mmap returned and nothing unmapped them yet.
        unsafe { libc::munmap(self.ptr.cast(), self.len_bytes) };
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
