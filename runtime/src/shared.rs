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
    value.lock().map_err(|_| {
        RuntimeError::Numeric(format!(
            "{what} was left in an unknown state by work that panicked; the run cannot continue"
        ))
    })
}
