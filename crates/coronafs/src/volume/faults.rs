//! Fault injection at the steps of a volume change: creating a layer file,
//! sizing it, syncing it, writing its map, syncing the directory, opening a
//! layer, committing the catalog. Tests arm a countdown and check that a
//! change failing at any step leaves the catalog and the files in agreement
//! and never blocks a later change.
//!
//! Compiled to nothing (every step passes) unless the crate is built for its
//! own tests or with the `testing` feature.

use std::io;

/// The armed fault, if any, and the steps passed so far.
#[derive(Debug, Default)]
pub struct Faults {
    #[cfg(any(test, feature = "testing"))]
    state: std::sync::Mutex<State>,
}

#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Default)]
struct State {
    /// Steps still to pass before the fault fires, and the errno it fires with.
    armed: Option<(usize, i32)>,
    /// The step the fault fired at.
    fired: Option<&'static str>,
    /// Every step passed since the last `arm`.
    seen: Vec<&'static str>,
}

impl Faults {
    /// Passes `step`, or fails it with the armed errno when the countdown ends.
    #[cfg(any(test, feature = "testing"))]
    pub fn check(&self, step: &'static str) -> io::Result<()> {
        let Ok(mut s) = self.state.lock() else { return Ok(()) };
        s.seen.push(step);
        match s.armed {
            Some((0, errno)) => {
                s.armed = None;
                s.fired = Some(step);
                Err(io::Error::from_raw_os_error(errno))
            }
            Some((n, errno)) => {
                s.armed = Some((n - 1, errno));
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Passes `step` (fault injection is compiled out).
    #[cfg(not(any(test, feature = "testing")))]
    #[inline(always)]
    pub fn check(&self, _step: &'static str) -> io::Result<()> {
        Ok(())
    }

    /// Makes the step after `skip` more steps fail with `errno`.
    #[cfg(any(test, feature = "testing"))]
    pub fn arm(&self, skip: usize, errno: i32) {
        if let Ok(mut s) = self.state.lock() {
            *s = State { armed: Some((skip, errno)), fired: None, seen: Vec::new() };
        }
    }

    /// Disarms, returning the step the fault fired at (if it did).
    #[cfg(any(test, feature = "testing"))]
    pub fn disarm(&self) -> Option<&'static str> {
        self.state.lock().ok().and_then(|mut s| {
            s.armed = None;
            s.fired.take()
        })
    }

    /// The steps passed since the last `arm`.
    #[cfg(any(test, feature = "testing"))]
    pub fn seen(&self) -> Vec<&'static str> {
        self.state.lock().map(|s| s.seen.clone()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_armed_step_fails_once() {
        let f = Faults::default();
        f.arm(1, libc::EIO);
        assert!(f.check("a").is_ok());
        assert_eq!(f.check("b").map_err(|e| e.raw_os_error()), Err(Some(libc::EIO)));
        assert!(f.check("c").is_ok());
        assert_eq!(f.seen(), vec!["a", "b", "c"]);
        assert_eq!(f.disarm(), Some("b"));
        assert_eq!(f.disarm(), None);
    }
}
