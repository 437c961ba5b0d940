//! Claiming a unix socket path for this process alone: the ingest API's socket, and the spool's
//! lock (a socket a live process answers on cannot be claimed twice, and a dead process's stale
//! socket is replaced). Its own module, below both users, so neither reaches into the other.

use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

/// Why a socket path could not be claimed.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// A live process answers on the socket.
    #[error("{0} is in use: another process (a second collector?) answers on it")]
    InUse(PathBuf),
    /// A file operation failed.
    #[error("cannot bind {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// Binds a unix socket at `path` (creating its folder), replacing a stale socket a dead process
/// left behind but never one a live process answers on, nor a file that is not a socket. The
/// socket is made `0660`: owner and group may connect.
///
/// # Errors
/// [`ClaimError`].
pub fn claim_socket(path: &Path) -> Result<std::os::unix::net::UnixListener, ClaimError> {
    let fail = |source| ClaimError::Io { path: path.to_owned(), source };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(fail)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(ClaimError::InUse(path.to_owned()));
            }
            tracing::info!(path = %path.display(), "Removing a stale socket left by an earlier process.");
            std::fs::remove_file(path).map_err(fail)?;
        }
        Ok(_) => {
            return Err(fail(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "a file that is not a socket is in the way",
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail(e)),
    }
    let listener = std::os::unix::net::UnixListener::bind(path).map_err(fail)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(fail)?;
    Ok(listener)
}
