//! Locking a `std::sync::Mutex` the one way the crate does it.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, taking the data even if a panicking thread poisoned it: every
/// critical section in the crate leaves its data consistent (a value set
/// whole, an entry inserted or removed), and a panic in one delivery must
/// not stop the others.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
