//! Logging into the host's log, tagged by the host with the guest's name.

use crate::bindings::foldhost::guest::log as raw;

/// A log level.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Very verbose diagnostics.
    Trace,
    /// Diagnostics.
    Debug,
    /// Normal operation.
    Info,
    /// Something unexpected that the guest handled.
    Warn,
    /// Something failed.
    Error,
}

impl From<Level> for raw::Level {
    fn from(level: Level) -> Self {
        match level {
            Level::Trace => raw::Level::Trace,
            Level::Debug => raw::Level::Debug,
            Level::Info => raw::Level::Info,
            Level::Warn => raw::Level::Warn,
            Level::Error => raw::Level::Error,
        }
    }
}

/// Logs `message` at `level`.
pub fn log(level: Level, message: &str) {
    raw::log(level.into(), message);
}

/// Logs `message` at [`Level::Trace`].
pub fn trace(message: &str) {
    log(Level::Trace, message);
}

/// Logs `message` at [`Level::Debug`].
pub fn debug(message: &str) {
    log(Level::Debug, message);
}

/// Logs `message` at [`Level::Info`].
pub fn info(message: &str) {
    log(Level::Info, message);
}

/// Logs `message` at [`Level::Warn`].
pub fn warn(message: &str) {
    log(Level::Warn, message);
}

/// Logs `message` at [`Level::Error`].
pub fn error(message: &str) {
    log(Level::Error, message);
}

/// Logs at [`Level::Trace`] with `format!` arguments: `trace!("{n} routes")`.
#[macro_export]
macro_rules! trace {
    ($($arg:tt)*) => { $crate::log::trace(&::std::format!($($arg)*)) };
}

/// Logs at [`Level::Debug`] with `format!` arguments: `debug!("{n} routes")`.
#[macro_export]
macro_rules! debug {
    ($($arg:tt)*) => { $crate::log::debug(&::std::format!($($arg)*)) };
}

/// Logs at [`Level::Info`] with `format!` arguments: `info!("{n} routes")`.
#[macro_export]
macro_rules! info {
    ($($arg:tt)*) => { $crate::log::info(&::std::format!($($arg)*)) };
}

/// Logs at [`Level::Warn`] with `format!` arguments: `warn!("{n} routes")`.
#[macro_export]
macro_rules! warn {
    ($($arg:tt)*) => { $crate::log::warn(&::std::format!($($arg)*)) };
}

/// Logs at [`Level::Error`] with `format!` arguments: `error!("{n} routes")`.
#[macro_export]
macro_rules! error {
    ($($arg:tt)*) => { $crate::log::error(&::std::format!($($arg)*)) };
}
