//! The bucket's log as the models keep it: inline and `Copy`, since the checker clones and hashes
//! states by the million.
//!
//! Invariant: a message's revision is its position + 1; `len ≤ N`.

/// A message of the log: a put or a delete of a key.
#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
pub(super) struct Op {
    pub(super) key: u8,
    pub(super) put: bool,
}

/// At most `N` messages, in revision order.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(super) struct Log<const N: usize> {
    ops: [Op; N],
    len: u8,
}

impl<const N: usize> Default for Log<N> {
    fn default() -> Self {
        Log {
            ops: [Op::default(); N],
            len: 0,
        }
    }
}

impl<const N: usize> Log<N> {
    /// Appends a message (the caller keeps `len < N`).
    pub(super) fn push(&mut self, op: Op) {
        assert!((self.len as usize) < N, "the model's log is full");
        self.ops[self.len as usize] = op;
        self.len += 1;
    }
}

impl<const N: usize> std::ops::Deref for Log<N> {
    type Target = [Op];
    fn deref(&self) -> &[Op] {
        &self.ops[..self.len as usize]
    }
}
