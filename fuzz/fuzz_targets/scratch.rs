//! A scratch directory for a whole fuzzing run, shared by the targets that read files.

use std::path::PathBuf;
use std::sync::OnceLock;

/// The run's scratch directory, in memory where there is a tmpfs (writing to a disk makes
/// the file-reading targets about 25 times slower).
pub fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let shm = std::path::Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            tempfile::tempdir_in(shm)
        } else {
            tempfile::tempdir()
        };
        dir.expect("temporary directory").keep()
    })
}
