//! Rule (f)'s sequential specification: one key's [`Register`], the operations a key's history
//! is made of ([`RegisterOp`], [`TimedRegisterOp`]), and the linearizability tester's drive
//! ([`linearizable`]). A register's revisions are the log's: it checks only that they rise in the
//! order the log holds them.

use stateright::semantics::{ConsistencyTester as _, LinearizabilityTester, SequentialSpec};

/// One key's register, the sequential specification rule (f) checks a key's writes against: its
/// revision (the stream sequence of its newest record; 0 when it has none), its value (`None`
/// after a delete), and the key's records on the log in their order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Register {
    /// The newest record's revision.
    pub revision: u64,
    /// Its value; `None` for none or a delete marker.
    pub value: Option<Vec<u8>>,
    /// Every revision the key's records hold on the log, ascending (every record enters the
    /// history, so a write can take effect only as the next of them); empty: any rising order.
    pub order: std::sync::Arc<[u64]>,
}

impl Register {
    /// Whether a record at `r` may take effect next: above the register's revision and, when the
    /// log's order is known, the key's next record on it.
    fn next_is(&self, r: u64) -> bool {
        if r <= self.revision {
            return false;
        }
        if self.order.is_empty() {
            return true;
        }
        let at = self.order.partition_point(|x| *x <= self.revision);
        self.order.get(at) == Some(&r)
    }
}

/// An operation on a [`Register`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegisterOp {
    /// A write of `value` (`None`: a delete), compare-and-set when `if_revision` is given, whose
    /// record landed at `landed` (`None`: it was refused and landed nowhere). The revision is the
    /// log's, which the specification cannot choose: it only checks revisions rise.
    Write {
        /// The value written.
        value: Option<Vec<u8>>,
        /// The compare-and-set revision.
        if_revision: Option<u64>,
        /// Where its record landed.
        landed: Option<u64>,
    },
    /// A read of the current value.
    Read,
}

/// What a [`RegisterOp`] returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegisterRet {
    /// The write took effect at this revision.
    Wrote(u64),
    /// The compare-and-set lost: the key is at this revision.
    Conflict(u64),
    /// The value read, at its revision.
    Value(u64, Option<Vec<u8>>),
    /// A write the specification would have applied, but which landed nowhere.
    WouldHaveApplied,
    /// A write landed at a revision that is not the key's next record on the log: no order of
    /// the log allows it here.
    OutOfOrder,
}

impl SequentialSpec for Register {
    type Op = RegisterOp;
    type Ret = RegisterRet;

    fn invoke(&mut self, op: &RegisterOp) -> RegisterRet {
        match op {
            RegisterOp::Read => RegisterRet::Value(self.revision, self.value.clone()),
            RegisterOp::Write {
                value,
                if_revision,
                landed,
            } => {
                if let Some(want) = if_revision
                    && *want != self.revision
                {
                    return RegisterRet::Conflict(self.revision);
                }
                match landed {
                    None => RegisterRet::WouldHaveApplied,
                    Some(r) if !self.next_is(*r) => RegisterRet::OutOfOrder,
                    Some(r) => {
                        self.revision = *r;
                        self.value = value.clone();
                        RegisterRet::Wrote(*r)
                    }
                }
            }
        }
    }
}

/// One operation of a key's history for the linearizability tester: invoked at `invoked`,
/// returned at `returned` (`None`: never, it may or may not have taken effect) with `ret`.
#[derive(Clone, Debug)]
pub struct TimedRegisterOp {
    /// What names it in an anomaly (its op id).
    pub name: String,
    /// When it was invoked.
    pub invoked: u64,
    /// When it returned; `u64::MAX` for an operation that took effect at an unknown instant after
    /// its invocation (an indeterminate write the log shows landed).
    pub returned: u64,
    /// The operation.
    pub op: RegisterOp,
    /// What it returned.
    pub ret: RegisterRet,
}

/// Whether `ops` (one key's history) are linearizable against a [`Register`] starting empty;
/// `Err` names the first return after which no linearization exists. Each operation runs on a
/// thread of its own in stateright's tester (an operation's window may overlap its own client's
/// next one: a retry answered later than the client moved on), so real-time order between any
/// two is what the tester records.
pub fn linearizable(ops: &[TimedRegisterOp]) -> Result<(), String> {
    // Events in real-time order: (instant, 0 = invoke / 1 = return, op index).
    let mut events: Vec<(u64, u8, usize)> = Vec::new();
    for (i, o) in ops.iter().enumerate() {
        events.push((o.invoked, 0, i));
        events.push((o.returned, 1, i));
    }
    events.sort();
    // The log fixes the order of the key's writes: the tester is told it, so its search never
    // tries an order the log refutes (without it, a history with many open windows took the
    // search beyond any time limit).
    let mut order: Vec<u64> = ops
        .iter()
        .filter_map(|o| match &o.op {
            RegisterOp::Write {
                landed: Some(r), ..
            } => Some(*r),
            _ => None,
        })
        .collect();
    order.sort_unstable();
    order.dedup();
    let mut tester = LinearizabilityTester::new(Register {
        order: order.into(),
        ..Register::default()
    });
    for (_, what, i) in events {
        let o = &ops[i];
        if what == 0 {
            tester
                .on_invoke(i, o.op.clone())
                .map_err(|e| format!("the tester refused the history: {e}"))?;
        } else {
            tester
                .on_return(i, o.ret.clone())
                .map_err(|e| format!("the tester refused the history: {e}"))?;
            if tester.serialized_history().is_none() {
                return Err(format!(
                    "no linearization once {} returned {:?} ({:?})",
                    o.name, o.ret, o.op
                ));
            }
        }
    }
    Ok(())
}
