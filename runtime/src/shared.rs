//! State shared between a rank's driver thread and the work it queues on
//! lanes. Lanes order the work with events, so these locks are never
//! contended in a correct schedule; they make the sharing safe, not ordered.

use crate::error::{Result, RuntimeError};
use std::sync::{Arc, Mutex, MutexGuard};

/// A value lane work reads or writes.
pub type Shared<T> = Arc<Mutex<T>>;

pub fn shared<T>(value: T) -> Shared<T> {
    Arc::new(Mutex::new(value))
}

/// Locks `value`; a lock poisoned by a panicking lane becomes an error
/// naming `what` instead of a second panic.
pub fn lock<'a, T>(value: &'a Mutex<T>, what: &str) -> Result<MutexGuard<'a, T>> {
    value.lock().map_err(|_| poisoned(what))
}

/// A value many lane works read at once (parameter buffers: the compute
/// lane's layers and the comm lane's combine both read them) and only a
/// gather writes.
pub type SharedRw<T> = Arc<std::sync::RwLock<T>>;

pub fn shared_rw<T>(value: T) -> SharedRw<T> {
    Arc::new(std::sync::RwLock::new(value))
}

pub fn read<'a, T>(
    value: &'a std::sync::RwLock<T>,
    what: &str,
) -> Result<std::sync::RwLockReadGuard<'a, T>> {
    value.read().map_err(|_| poisoned(what))
}

pub fn write<'a, T>(
    value: &'a std::sync::RwLock<T>,
    what: &str,
) -> Result<std::sync::RwLockWriteGuard<'a, T>> {
    value.write().map_err(|_| poisoned(what))
}

fn poisoned(what: &str) -> RuntimeError {
    RuntimeError::Numeric(format!(
        "{what} was left in an unknown state by work that panicked; the run cannot continue"
    ))
}
