//! CPU seconds of the processes a row measures (this one, the node, nats-server), from
//! `/proc/PID/stat`.

/// CPU seconds (utime + stime) of `pid` so far, from `/proc/PID/stat`.
pub(super) fn cpu_secs(pid: u32) -> f64 {
    // USER_HZ, which the kernel reports these in, is 100 on Linux.
    const TICKS: f64 = 100.0;
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // The fields after the command name (which is in parentheses and may hold spaces).
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are the 14th and 15th fields; `rest` starts at the 3rd.
    let field = |i: usize| {
        f.get(i - 3)
            .and_then(|s| s.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (field(14) + field(15)) / TICKS
}

/// The processes of the nats-server on `port` (and any wrapper that started it with the same
/// arguments): those whose command line has `-p PORT` and `--ports_file_dir`.
pub(super) fn nats_pids(port: u16) -> Vec<u32> {
    let port = port.to_string();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                return false;
            };
            let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
            args.contains(&&b"--ports_file_dir"[..])
                && args
                    .windows(2)
                    .any(|w| w[0] == b"-p" && w[1] == port.as_bytes())
        })
        .collect()
}

/// CPU seconds of the three processes: this one, the node, nats-server.
#[derive(Clone, Copy, Default)]
pub(super) struct Cpu {
    pub(super) bench: f64,
    pub(super) node: f64,
    pub(super) nats: f64,
}

impl Cpu {
    pub(super) fn now(node: u32, nats: &[u32]) -> Cpu {
        Cpu {
            bench: cpu_secs(std::process::id()),
            node: cpu_secs(node),
            nats: nats.iter().map(|p| cpu_secs(*p)).sum(),
        }
    }

    /// Cores used between `self` and `later`, `secs` apart.
    pub(super) fn cores(self, later: Cpu, secs: f64) -> Cpu {
        Cpu {
            bench: (later.bench - self.bench) / secs,
            node: (later.node - self.node) / secs,
            nats: (later.nats - self.nats) / secs,
        }
    }
}
