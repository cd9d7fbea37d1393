//! Rendezvous: finding ranks the way torchrun and srun set them, and the TCP exchange
//! that hands rank 0's bytes to the others.
//!
//! [`Launch::discover`] reads the launcher's variables from an [`EnvVars`]
//! (the process environment, or a map in tests): torchrun's `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`, or srun's `SLURM_*` twins. With none set the process runs
//! alone (and drives every local device, or N thread ranks on the CPU).
//!
//! [`hand_out`] then moves one byte string (a 128-byte NCCL unique id)
//! from rank 0 to every other rank over TCP: rank 0 listens on
//! `MASTER_ADDR:MASTER_PORT`, the others connect with retries until a
//! deadline. Everything is bounded in time; errors name the address and the
//! rank.

use crate::error::{Result, RuntimeError};
use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Environment variables, read through this map so tests need not touch
/// the real environment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EnvVars {
    vars: BTreeMap<String, String>,
}

impl EnvVars {
    /// A snapshot of the process environment (values that are not UTF-8
    /// are kept lossily, so they fail validation with a readable message).
    pub fn from_process() -> Self {
        EnvVars {
            vars: std::env::vars_os()
                .map(|(k, v)| {
                    (
                        k.to_string_lossy().into_owned(),
                        v.to_string_lossy().into_owned(),
                    )
                })
                .collect(),
        }
    }

    pub fn from_pairs<K: Into<String>, V: Into<String>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        EnvVars {
            vars: pairs
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        }
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.vars.get(name).map(String::as_str)
    }

    pub fn set(&mut self, name: impl Into<String>, value: impl Into<String>) {
        self.vars.insert(name.into(), value.into());
    }
}

/// Which launcher set the variables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    Torchrun,
    Slurm,
}

/// This process's place in a multi-process job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankInfo {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    /// Where rank 0 listens for the rendezvous.
    pub master_addr: String,
    pub master_port: u16,
    pub launcher: Launcher,
}

/// How this process was started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Launch {
    /// No launcher variables: one process drives every local device (or N
    /// thread ranks on the CPU).
    SingleProcess,
    /// One rank of a job started by torchrun or srun.
    Distributed(RankInfo),
}

fn env_error(message: String) -> RuntimeError {
    RuntimeError::Unsupported(format!("launch environment: {message}"))
}

fn invalid(name: &str, value: &str, expected: &str) -> RuntimeError {
    env_error(format!(
        "{name}={value:?} is not valid: expected {expected}"
    ))
}

fn parse_count(env: &EnvVars, name: &str, expected: &str) -> Result<Option<usize>> {
    match env.get(name) {
        None => Ok(None),
        Some(value) => value
            .trim()
            .parse::<usize>()
            .map(Some)
            .map_err(|_| invalid(name, value, expected)),
    }
}

fn require(value: Option<usize>, name: &str, launcher: &str) -> Result<usize> {
    value.ok_or_else(|| {
        env_error(format!(
            "{name} is not set, but other {launcher} variables are: set it too (or unset them \
             all to run as a single process)"
        ))
    })
}

fn parse_port(name: &str, value: &str) -> Result<u16> {
    match value.trim().parse::<u16>() {
        Ok(port) if port > 0 => Ok(port),
        _ => Err(invalid(name, value, "a TCP port between 1 and 65535")),
    }
}

fn check_addr(name: &str, value: &str) -> Result<String> {
    let addr = value.trim();
    if addr.is_empty() || addr.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(invalid(
            name,
            value,
            "a host name or IP address of the node running rank 0",
        ));
    }
    Ok(addr.to_string())
}

/// Checks that the four numbers fit together; names the variables involved.
fn check_ranks(
    names: [&str; 4],
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
) -> Result<()> {
    let [rank_var, world_var, local_rank_var, local_world_var] = names;
    if world_size == 0 {
        return Err(invalid(world_var, "0", "at least 1 process"));
    }
    if rank >= world_size {
        return Err(env_error(format!(
            "{rank_var}={rank} is out of range: {world_var}={world_size} allows ranks 0 to {}",
            world_size - 1
        )));
    }
    if local_world_size == 0 {
        return Err(invalid(local_world_var, "0", "at least 1 process per node"));
    }
    if local_rank >= local_world_size {
        return Err(env_error(format!(
            "{local_rank_var}={local_rank} is out of range: {local_world_var}={local_world_size} \
             allows local ranks 0 to {}",
            local_world_size - 1
        )));
    }
    if local_world_size > world_size {
        return Err(env_error(format!(
            "{local_world_var}={local_world_size} is larger than {world_var}={world_size}: a \
             node cannot run more processes than the whole job"
        )));
    }
    Ok(())
}

const TORCHRUN_VARS: [&str; 4] = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"];

impl Launch {
    /// Reads the launcher's variables from the process environment.
    pub fn from_process_env() -> Result<Launch> {
        Self::discover(&EnvVars::from_process())
    }

    /// Reads the launcher's variables from `env`. torchrun's variables win
    /// over SLURM's (under `srun torchrun` they describe the real ranks).
    pub fn discover(env: &EnvVars) -> Result<Launch> {
        if TORCHRUN_VARS.iter().any(|v| env.get(v).is_some()) {
            return discover_torchrun(env).map(Launch::Distributed);
        }
        if env.get("SLURM_PROCID").is_some() {
            return discover_slurm(env).map(Launch::Distributed);
        }
        Ok(Launch::SingleProcess)
    }
}

fn discover_torchrun(env: &EnvVars) -> Result<RankInfo> {
    let rank = parse_count(env, "RANK", "a non-negative integer (this process's rank)")?;
    let world_size = parse_count(
        env,
        "WORLD_SIZE",
        "a positive integer (processes in the job)",
    )?;
    let local_rank = parse_count(
        env,
        "LOCAL_RANK",
        "a non-negative integer (this process's rank on its node)",
    )?;
    let local_world_size = parse_count(
        env,
        "LOCAL_WORLD_SIZE",
        "a positive integer (processes on this node)",
    )?;
    let rank = require(rank, "RANK", "torchrun")?;
    let world_size = require(world_size, "WORLD_SIZE", "torchrun")?;
    // A hand-written launch may leave out the local pair: that means one
    // node. One without the other is a mistake worth reporting.
    let (local_rank, local_world_size) = match (local_rank, local_world_size) {
        (Some(lr), Some(lws)) => (lr, lws),
        (None, None) => (rank, world_size),
        (Some(_), None) => {
            return Err(env_error(
                "LOCAL_RANK is set but LOCAL_WORLD_SIZE is not: set both, or neither for a \
                 single-node job"
                    .into(),
            ));
        }
        (None, Some(_)) => {
            return Err(env_error(
                "LOCAL_WORLD_SIZE is set but LOCAL_RANK is not: set both, or neither for a \
                 single-node job"
                    .into(),
            ));
        }
    };
    check_ranks(
        TORCHRUN_VARS,
        rank,
        world_size,
        local_rank,
        local_world_size,
    )?;
    let master_addr = match env.get("MASTER_ADDR") {
        Some(addr) => check_addr("MASTER_ADDR", addr)?,
        None => {
            return Err(env_error(
                "MASTER_ADDR is not set: torchrun sets it; when launching by hand, set it to \
                 the address of the node running rank 0"
                    .into(),
            ));
        }
    };
    let master_port = match env.get("MASTER_PORT") {
        Some(port) => parse_port("MASTER_PORT", port)?,
        None => {
            return Err(env_error(
                "MASTER_PORT is not set: torchrun sets it; when launching by hand, set it to a \
                 free TCP port on the node running rank 0"
                    .into(),
            ));
        }
    };
    Ok(RankInfo {
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr,
        master_port,
        launcher: Launcher::Torchrun,
    })
}

/// Expands SLURM's compressed task counts (`2(x3),1` = 2,2,2,1).
fn expand_tasks_per_node(name: &str, value: &str) -> Result<Vec<usize>> {
    let expected = "comma-separated task counts such as `4` or `2(x3),1`";
    let mut counts = Vec::new();
    for part in value.trim().split(',') {
        let (count, repeat) = match part.split_once("(x") {
            Some((count, rest)) => {
                let repeat = rest
                    .strip_suffix(')')
                    .and_then(|r| r.parse::<usize>().ok())
                    .ok_or_else(|| invalid(name, value, expected))?;
                (count, repeat)
            }
            None => (part, 1),
        };
        let count = count
            .parse::<usize>()
            .map_err(|_| invalid(name, value, expected))?;
        if repeat > 1 << 20 {
            return Err(invalid(name, value, expected));
        }
        counts.extend(std::iter::repeat_n(count, repeat));
    }
    Ok(counts)
}

/// Processes SLURM runs on this node.
fn slurm_local_world_size(env: &EnvVars, world_size: usize) -> Result<(&'static str, usize)> {
    if let Some(n) = parse_count(
        env,
        "SLURM_NTASKS_PER_NODE",
        "a positive integer (tasks per node)",
    )? {
        return Ok(("SLURM_NTASKS_PER_NODE", n));
    }
    for name in ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"] {
        let Some(value) = env.get(name) else {
            continue;
        };
        let counts = expand_tasks_per_node(name, value)?;
        if counts.iter().all(|c| *c == counts[0]) {
            return Ok((name, counts[0]));
        }
        let node = parse_count(
            env,
            "SLURM_NODEID",
            "a non-negative integer (this node's index)",
        )?
        .ok_or_else(|| {
            env_error(format!(
                "{name}={value:?} gives different task counts per node, and SLURM_NODEID \
                     (which node this is) is not set"
            ))
        })?;
        return counts.get(node).map(|n| (name, *n)).ok_or_else(|| {
            env_error(format!(
                "SLURM_NODEID={node} is out of range for {name}={value:?} ({} nodes)",
                counts.len()
            ))
        });
    }
    match parse_count(
        env,
        "SLURM_NNODES",
        "a positive integer (nodes in the step)",
    )? {
        Some(1) => Ok(("SLURM_NNODES", world_size)),
        _ => Err(env_error(
            "cannot tell how many tasks run on this node: none of SLURM_NTASKS_PER_NODE, \
             SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE is set (launch with srun, or \
             pass srun's --ntasks-per-node)"
                .into(),
        )),
    }
}

/// The first host of a SLURM node list, when it is a plain list
/// (`node1,node2`) or one bracketed range (`gpu[03-07,9]`); `None` for
/// anything more involved.
pub fn first_slurm_host(nodelist: &str) -> Option<String> {
    let mut depth = 0usize;
    let mut end = nodelist.len();
    for (i, c) in nodelist.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1)?,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let first = nodelist[..end].trim();
    let host = match first.split_once('[') {
        None => first.to_string(),
        Some((prefix, rest)) => {
            let (ranges, suffix) = rest.split_once(']')?;
            if suffix.contains('[') || suffix.contains(']') {
                return None;
            }
            let number = ranges.split([',', '-']).next()?;
            if number.is_empty() || !number.chars().all(|c| c.is_ascii_digit()) {
                return None;
            }
            format!("{prefix}{number}{suffix}")
        }
    };
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_');
    (!host.is_empty() && host.chars().all(plain)).then_some(host)
}

fn discover_slurm(env: &EnvVars) -> Result<RankInfo> {
    let rank = parse_count(
        env,
        "SLURM_PROCID",
        "a non-negative integer (this task's rank)",
    )?;
    let rank = require(rank, "SLURM_PROCID", "SLURM")?;
    let (world_var, world_size) =
        match parse_count(env, "SLURM_NTASKS", "a positive integer (tasks in the job)")? {
            Some(n) => ("SLURM_NTASKS", n),
            None => (
                "SLURM_NPROCS",
                require(
                    parse_count(env, "SLURM_NPROCS", "a positive integer (tasks in the job)")?,
                    "SLURM_NTASKS",
                    "SLURM",
                )?,
            ),
        };
    let local_rank = require(
        parse_count(
            env,
            "SLURM_LOCALID",
            "a non-negative integer (this task's rank on its node)",
        )?,
        "SLURM_LOCALID",
        "SLURM",
    )?;
    let (local_world_var, local_world_size) = slurm_local_world_size(env, world_size)?;
    check_ranks(
        ["SLURM_PROCID", world_var, "SLURM_LOCALID", local_world_var],
        rank,
        world_size,
        local_rank,
        local_world_size,
    )?;
    // Rank 0 runs on the first node of the step (block distribution), which
    // is not always the node srun was launched from (an interactive salloc
    // launches from a login node), so the node list comes first.
    let master_addr = if let Some(addr) = env.get("MASTER_ADDR") {
        check_addr("MASTER_ADDR", addr)?
    } else if let Some(host) = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"]
        .iter()
        .find_map(|v| env.get(v).and_then(first_slurm_host))
    {
        host
    } else if let Some(addr) = env.get("SLURM_LAUNCH_NODE_IPADDR") {
        check_addr("SLURM_LAUNCH_NODE_IPADDR", addr)?
    } else {
        let list = env
            .get("SLURM_STEP_NODELIST")
            .map(|v| format!(" (SLURM_STEP_NODELIST={v:?} is not a plain host list)"))
            .unwrap_or_default();
        return Err(env_error(format!(
            "cannot tell where rank 0 runs{list}: set MASTER_ADDR to its host"
        )));
    };
    let master_port = if let Some(port) = env.get("MASTER_PORT") {
        parse_port("MASTER_PORT", port)?
    } else if let Some(job) = env.get("SLURM_JOB_ID") {
        // Every task of the job derives the same port from the job id (the
        // PyTorch Lightning convention); concurrent jobs on one node differ.
        let id = job
            .trim()
            .parse::<u64>()
            .map_err(|_| invalid("SLURM_JOB_ID", job, "a job number"))?;
        15000 + (id % 10000) as u16
    } else {
        return Err(env_error(
            "MASTER_PORT is not set and there is no SLURM_JOB_ID to derive one from: set \
             MASTER_PORT to a free TCP port on the node running rank 0"
                .into(),
        ));
    };
    Ok(RankInfo {
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr,
        master_port,
        launcher: Launcher::Slurm,
    })
}

// ---- rendezvous ---------------------------------------------------------

const MAGIC: &[u8; 4] = b"HGRV";
const VERSION: u8 = 1;
const HELLO_LEN: usize = 4 + 1 + 4 + 4;
const STATUS_OK: u8 = 0;
const STATUS_REFUSED: u8 = 1;
/// The largest payload the rendezvous moves; a NCCL id is 128 bytes.
pub const MAX_PAYLOAD: usize = 1 << 20;
/// How long rank 0 waits for one connected client to say who it is, so a
/// stray connection cannot hold up the others.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// How often rank 0 checks for new connections: std has no accept with a
/// timeout, and the rendezvous runs once per job, so polling is cheap.
const ACCEPT_POLL: Duration = Duration::from_millis(10);

fn rendezvous_error(addr: &str, rank: usize, message: String) -> RuntimeError {
    RuntimeError::Peer {
        rank,
        message: format!("rendezvous at {addr}: {message}"),
    }
}

fn to_u32(value: usize) -> [u8; 4] {
    u32::try_from(value).unwrap_or(u32::MAX).to_le_bytes()
}

fn read_u32(bytes: &[u8]) -> usize {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[..4]);
    u32::from_le_bytes(word) as usize
}

/// Rank 0's side of the rendezvous: a bound listener.
#[derive(Debug)]
pub struct RendezvousServer {
    listener: TcpListener,
    display: String,
    world_size: usize,
}

impl RendezvousServer {
    /// Listens on `port` for `world_size - 1` other ranks. If `addr` is a
    /// loopback address the listener binds to it; otherwise to every
    /// interface, since `MASTER_ADDR` may name this host by a public name.
    /// Port 0 picks a free port (see [`Self::local_addr`]).
    pub fn bind(addr: &str, port: u16, world_size: usize) -> Result<Self> {
        let display = format!("{addr}:{port}");
        let resolved = (addr, port)
            .to_socket_addrs()
            .map_err(|e| rendezvous_error(&display, 0, format!("cannot resolve the address: {e}")))?
            .next()
            .ok_or_else(|| {
                rendezvous_error(&display, 0, "the address resolves to nothing".into())
            })?;
        let bind_to = if resolved.ip().is_loopback() {
            resolved
        } else {
            let any = match resolved.ip() {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            };
            SocketAddr::new(any, port)
        };
        let listener = TcpListener::bind(bind_to).map_err(|e| {
            rendezvous_error(
                &display,
                0,
                format!(
                    "rank 0 cannot listen on {bind_to}: {e} (is MASTER_PORT in use by another \
                     job? pick another)"
                ),
            )
        })?;
        let display = match listener.local_addr() {
            Ok(local) => format!("{addr}:{}", local.port()),
            Err(_) => display,
        };
        Ok(RendezvousServer {
            listener,
            display,
            world_size,
        })
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|e| rendezvous_error(&self.display, 0, e.to_string()))
    }

    /// Hands `payload` to every rank 1..world_size; returns once all have
    /// it, or fails naming the ranks that did not come within `timeout`.
    pub fn serve(self, payload: &[u8], timeout: Duration) -> Result<()> {
        let addr = &self.display;
        if payload.len() > MAX_PAYLOAD {
            return Err(RuntimeError::InvalidArgument(format!(
                "rendezvous payload of {} bytes exceeds the {MAX_PAYLOAD}-byte limit",
                payload.len()
            )));
        }
        let deadline = crate::lane::thread::deadline_after(timeout);
        let mut served = vec![false; self.world_size];
        served[0] = true;
        self.listener
            .set_nonblocking(true)
            .map_err(|e| rendezvous_error(addr, 0, e.to_string()))?;
        while served.iter().any(|s| !s) {
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..self.world_size).filter(|r| !served[*r]).collect();
                return Err(rendezvous_error(
                    addr,
                    missing[0],
                    format!(
                        "rank {} did not connect within {timeout:?} (missing ranks: {missing:?}): \
                         it may not have started, or cannot reach this address",
                        missing[0]
                    ),
                ));
            }
            match self.listener.accept() {
                Ok((stream, _peer)) => {
                    let patience = HELLO_TIMEOUT.min(deadline - now).max(ACCEPT_POLL);
                    if let Some(rank) = self.greet(stream, payload, patience, &served)? {
                        served[rank] = true;
                    }
                }
                Err(e)
                    if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted =>
                {
                    std::thread::sleep(ACCEPT_POLL.min(deadline - now));
                }
                Err(e) => {
                    return Err(rendezvous_error(addr, 0, format!("accept failed: {e}")));
                }
            }
        }
        Ok(())
    }

    /// Reads one client's hello and answers it. `Ok(Some(rank))` when that
    /// rank got the payload; `Ok(None)` for a stray or broken connection
    /// (ignored: the rank retries); an error when a rank's settings
    /// contradict rank 0's, which no retry can fix.
    fn greet(
        &self,
        mut stream: TcpStream,
        payload: &[u8],
        patience: Duration,
        served: &[bool],
    ) -> Result<Option<usize>> {
        let addr = &self.display;
        if stream.set_nonblocking(false).is_err()
            || stream.set_read_timeout(Some(patience)).is_err()
            || stream.set_write_timeout(Some(patience)).is_err()
        {
            return Ok(None);
        }
        let mut hello = [0u8; HELLO_LEN];
        if stream.read_exact(&mut hello).is_err() || &hello[..4] != MAGIC {
            return Ok(None);
        }
        let version = hello[4];
        let rank = read_u32(&hello[5..9]);
        let world_size = read_u32(&hello[9..13]);
        let problem = if version != VERSION {
            Some(format!(
                "rank {rank} speaks rendezvous version {version}, rank 0 speaks {VERSION}: run \
                 the same hybridgen build on every node"
            ))
        } else if world_size != self.world_size {
            Some(format!(
                "rank {rank} has a world size of {world_size} but rank 0 has {}: every rank \
                 must get the same WORLD_SIZE",
                self.world_size
            ))
        } else if rank == 0 || rank >= self.world_size {
            Some(format!(
                "a process claiming rank {rank} connected, but only ranks 1 to {} exist",
                self.world_size - 1
            ))
        } else if served[rank] {
            Some(format!(
                "rank {rank} connected twice: two processes have the same RANK"
            ))
        } else {
            None
        };
        let mut reply = Vec::with_capacity(9 + payload.len());
        reply.extend_from_slice(MAGIC);
        match &problem {
            Some(message) => {
                reply.push(STATUS_REFUSED);
                reply.extend_from_slice(&to_u32(message.len()));
                reply.extend_from_slice(message.as_bytes());
            }
            None => {
                reply.push(STATUS_OK);
                reply.extend_from_slice(&to_u32(payload.len()));
                reply.extend_from_slice(payload);
            }
        }
        let sent = stream.write_all(&reply).and_then(|()| stream.flush());
        match problem {
            Some(message) => Err(rendezvous_error(addr, rank, message)),
            None => Ok(sent.is_ok().then_some(rank)),
        }
    }
}

/// Why one attempt to fetch the payload did not succeed.
enum Attempt {
    /// Worth retrying (nothing listening yet, connection dropped, ...).
    Retry(String),
    /// Rank 0 refused this rank: retrying cannot help.
    Refused(String),
}

fn fetch_once(
    target: SocketAddr,
    rank: usize,
    world_size: usize,
    patience: Duration,
) -> std::result::Result<Vec<u8>, Attempt> {
    let retry = |e: std::io::Error| Attempt::Retry(e.to_string());
    let mut stream = TcpStream::connect_timeout(&target, patience).map_err(retry)?;
    stream.set_read_timeout(Some(patience)).map_err(retry)?;
    stream.set_write_timeout(Some(patience)).map_err(retry)?;
    let mut hello = Vec::with_capacity(HELLO_LEN);
    hello.extend_from_slice(MAGIC);
    hello.push(VERSION);
    hello.extend_from_slice(&to_u32(rank));
    hello.extend_from_slice(&to_u32(world_size));
    stream.write_all(&hello).map_err(retry)?;
    let mut header = [0u8; 9];
    stream.read_exact(&mut header).map_err(retry)?;
    if &header[..4] != MAGIC {
        return Err(Attempt::Refused(format!(
            "{target} answered with something that is not a hybridgen rendezvous (is another \
             service using MASTER_PORT?)"
        )));
    }
    let len = read_u32(&header[5..9]);
    if len > MAX_PAYLOAD {
        return Err(Attempt::Refused(format!(
            "rank 0 announced a {len}-byte payload, more than the {MAX_PAYLOAD}-byte limit"
        )));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).map_err(retry)?;
    if header[4] == STATUS_OK {
        Ok(body)
    } else {
        Err(Attempt::Refused(format!(
            "rank 0 refused rank {rank}: {}",
            String::from_utf8_lossy(&body)
        )))
    }
}

/// A non-zero rank's side: connects to rank 0 at `addr:port` (retrying
/// while rank 0 is not up yet) and returns its payload, or fails after
/// `timeout` with an error naming the address and this rank.
pub fn fetch_payload(
    addr: &str,
    port: u16,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let display = format!("{addr}:{port}");
    let deadline = crate::lane::thread::deadline_after(timeout);
    let mut backoff = Duration::from_millis(20);
    let mut last = String::from("no attempt finished");
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(rendezvous_error(
                &display,
                0,
                format!(
                    "rank {rank} could not get the payload from rank 0 within {timeout:?} (last \
                     error: {last}): is rank 0 running, and can this host reach \
                     MASTER_ADDR:MASTER_PORT?"
                ),
            ));
        }
        let patience = (deadline - now).min(Duration::from_secs(2));
        // Resolve on every attempt: a node's name may appear in DNS late.
        match (addr, port).to_socket_addrs() {
            Ok(targets) => {
                for target in targets {
                    match fetch_once(target, rank, world_size, patience) {
                        Ok(payload) => return Ok(payload),
                        Err(Attempt::Refused(message)) => {
                            return Err(rendezvous_error(&display, 0, message));
                        }
                        Err(Attempt::Retry(message)) => last = format!("{target}: {message}"),
                    }
                }
            }
            Err(e) => last = format!("cannot resolve {addr}: {e}"),
        }
        let now = Instant::now();
        if now < deadline {
            std::thread::sleep(backoff.min(deadline - now));
        }
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// Every rank calls this with the same `timeout`: rank 0 makes the payload
/// with `make_payload` and hands it out; the others fetch it. All return
/// the payload.
pub fn hand_out(
    info: &RankInfo,
    make_payload: impl FnOnce() -> Result<Vec<u8>>,
    timeout: Duration,
) -> Result<Vec<u8>> {
    if info.rank == 0 {
        let server = RendezvousServer::bind(&info.master_addr, info.master_port, info.world_size)?;
        let payload = make_payload()?;
        server.serve(&payload, timeout)?;
        Ok(payload)
    } else {
        fetch_payload(
            &info.master_addr,
            info.master_port,
            info.rank,
            info.world_size,
            timeout,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> EnvVars {
        EnvVars::from_pairs(pairs.iter().copied())
    }

    fn torchrun(rank: &str) -> EnvVars {
        env(&[
            ("RANK", rank),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
    }

    fn err(env: &EnvVars) -> String {
        Launch::discover(env).unwrap_err().to_string()
    }

    #[test]
    fn nothing_set_is_single_process() {
        assert_eq!(Launch::discover(&env(&[])).unwrap(), Launch::SingleProcess);
        // An allocation shell without srun has job variables but no task id.
        let salloc = env(&[("SLURM_JOB_ID", "77"), ("MASTER_ADDR", "x")]);
        assert_eq!(Launch::discover(&salloc).unwrap(), Launch::SingleProcess);
    }

    #[test]
    fn torchrun_set_is_read() {
        let launch = Launch::discover(&torchrun("5")).unwrap();
        assert_eq!(
            launch,
            Launch::Distributed(RankInfo {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 4,
                master_addr: "10.0.0.1".into(),
                master_port: 29500,
                launcher: Launcher::Torchrun,
            })
        );
    }

    #[test]
    fn torchrun_without_local_pair_is_one_node() {
        let e = env(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1234"),
        ]);
        let Launch::Distributed(info) = Launch::discover(&e).unwrap() else {
            panic!("expected a distributed launch");
        };
        assert_eq!((info.local_rank, info.local_world_size), (2, 4));
    }

    #[test]
    fn torchrun_errors_name_the_variable_and_value() {
        let mut e = torchrun("abc");
        assert!(err(&e).contains("RANK=\"abc\" is not valid: expected a non-negative integer"));
        e.set("RANK", "8");
        assert!(err(&e).contains("RANK=8 is out of range: WORLD_SIZE=8 allows ranks 0 to 7"));
        e.set("RANK", "3");
        e.set("WORLD_SIZE", "0");
        assert!(err(&e).contains("WORLD_SIZE=\"0\" is not valid"));
        e.set("WORLD_SIZE", "8");
        e.set("LOCAL_RANK", "4");
        assert!(err(&e).contains("LOCAL_RANK=4 is out of range: LOCAL_WORLD_SIZE=4"));
        e.set("LOCAL_RANK", "0");
        e.set("LOCAL_WORLD_SIZE", "16");
        assert!(err(&e).contains("LOCAL_WORLD_SIZE=16 is larger than WORLD_SIZE=8"));
        e.set("LOCAL_WORLD_SIZE", "4");
        e.set("MASTER_PORT", "70000");
        assert!(err(&e).contains("MASTER_PORT=\"70000\" is not valid: expected a TCP port"));
        e.set("MASTER_PORT", "0");
        assert!(err(&e).contains("MASTER_PORT=\"0\""));
        e.set("MASTER_PORT", "29500");
        e.set("MASTER_ADDR", " ");
        assert!(err(&e).contains("MASTER_ADDR=\" \" is not valid"));
        e.set("WORLD_SIZE", "-1");
        assert!(err(&e).contains("WORLD_SIZE=\"-1\""));

        let only_rank = env(&[("RANK", "0")]);
        assert!(err(&only_rank).contains("WORLD_SIZE is not set"));
        let half_local = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]);
        assert!(err(&half_local).contains("LOCAL_RANK is set but LOCAL_WORLD_SIZE is not"));
        let no_master = env(&[("RANK", "0"), ("WORLD_SIZE", "2")]);
        assert!(err(&no_master).contains("MASTER_ADDR is not set"));
        let no_port = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]);
        assert!(err(&no_port).contains("MASTER_PORT is not set"));
    }

    fn slurm() -> EnvVars {
        env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_STEP_NODELIST", "gpu[007-008]"),
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_LAUNCH_NODE_IPADDR", "10.1.1.1"),
        ])
    }

    #[test]
    fn slurm_set_is_read_with_derived_master() {
        let Launch::Distributed(info) = Launch::discover(&slurm()).unwrap() else {
            panic!("expected a distributed launch");
        };
        assert_eq!(info.launcher, Launcher::Slurm);
        assert_eq!((info.rank, info.world_size), (5, 8));
        assert_eq!((info.local_rank, info.local_world_size), (1, 4));
        assert_eq!(info.master_addr, "gpu007");
        assert_eq!(info.master_port, 15000 + 3456);

        let mut e = slurm();
        e.set("MASTER_ADDR", "head");
        e.set("MASTER_PORT", "29400");
        e.set("SLURM_NTASKS_PER_NODE", "4");
        let Launch::Distributed(info) = Launch::discover(&e).unwrap() else {
            panic!("expected a distributed launch");
        };
        assert_eq!(
            (info.master_addr.as_str(), info.master_port),
            ("head", 29400)
        );

        // A node list too involved to parse falls back to the launch node.
        let mut e = slurm();
        e.set("SLURM_STEP_NODELIST", "a[1-2]b[3-4]");
        let Launch::Distributed(info) = Launch::discover(&e).unwrap() else {
            panic!("expected a distributed launch");
        };
        assert_eq!(info.master_addr, "10.1.1.1");
    }

    #[test]
    fn slurm_uneven_nodes_use_the_node_id() {
        let mut e = slurm();
        e.set("SLURM_STEP_TASKS_PER_NODE", "3,2(x2)");
        e.set("SLURM_NTASKS", "7");
        assert!(err(&e).contains("SLURM_NODEID"));
        e.set("SLURM_NODEID", "2");
        let Launch::Distributed(info) = Launch::discover(&e).unwrap() else {
            panic!("expected a distributed launch");
        };
        assert_eq!(info.local_world_size, 2);
        e.set("SLURM_NODEID", "3");
        assert!(err(&e).contains("SLURM_NODEID=3 is out of range"));
    }

    #[test]
    fn slurm_errors_name_the_variable() {
        let mut e = slurm();
        e.set("SLURM_PROCID", "x");
        assert!(err(&e).contains("SLURM_PROCID=\"x\" is not valid"));
        let mut e = slurm();
        e.set("SLURM_PROCID", "9");
        assert!(err(&e).contains("SLURM_PROCID=9 is out of range: SLURM_NTASKS=8"));
        let mut e = slurm();
        e.set("SLURM_LOCALID", "4");
        assert!(err(&e).contains("SLURM_LOCALID=4 is out of range: SLURM_STEP_TASKS_PER_NODE=4"));
        let mut e = slurm();
        e.set("SLURM_STEP_TASKS_PER_NODE", "4(y2)");
        assert!(err(&e).contains("SLURM_STEP_TASKS_PER_NODE=\"4(y2)\" is not valid"));
        let mut e = slurm();
        e.set("SLURM_JOB_ID", "abc");
        assert!(err(&e).contains("SLURM_JOB_ID=\"abc\""));
        let e = env(&[("SLURM_PROCID", "0"), ("SLURM_LOCALID", "0")]);
        assert!(err(&e).contains("SLURM_NTASKS is not set"));
        let e = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NNODES", "2"),
        ]);
        assert!(err(&e).contains("cannot tell how many tasks run on this node"));
        let e = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NNODES", "1"),
            ("SLURM_JOB_ID", "1"),
        ]);
        assert!(err(&e).contains("cannot tell where rank 0 runs"));
    }

    #[test]
    fn torchrun_wins_over_slurm() {
        let mut e = slurm();
        for (k, v) in [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ] {
            e.set(k, v);
        }
        let Launch::Distributed(info) = Launch::discover(&e).unwrap() else {
            panic!("expected a distributed launch");
        };
        assert_eq!(info.launcher, Launcher::Torchrun);
    }

    #[test]
    fn first_host_of_node_lists() {
        assert_eq!(first_slurm_host("node1"), Some("node1".into()));
        assert_eq!(first_slurm_host("node1,node2"), Some("node1".into()));
        assert_eq!(first_slurm_host("gpu[03-07,9]"), Some("gpu03".into()));
        assert_eq!(first_slurm_host("gpu[12,3],cpu1"), Some("gpu12".into()));
        assert_eq!(first_slurm_host("r[1-2]-ib"), Some("r1-ib".into()));
        assert_eq!(first_slurm_host("a[1-2]b[3-4]"), None);
        assert_eq!(first_slurm_host("gpu[x]"), None);
        assert_eq!(first_slurm_host(""), None);
        assert_eq!(first_slurm_host("bad]"), None);
    }

    /// A port nothing listens on right now.
    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    const PATIENT: Duration = Duration::from_secs(20);

    #[test]
    fn rendezvous_hands_the_payload_to_every_rank() {
        let server = RendezvousServer::bind("127.0.0.1", 0, 4).unwrap();
        let port = server.local_addr().unwrap().port();
        let id: Vec<u8> = (0..128u8).collect();
        let got = std::thread::scope(|s| {
            let clients: Vec<_> = (1..4)
                .map(|rank| s.spawn(move || fetch_payload("127.0.0.1", port, rank, 4, PATIENT)))
                .collect();
            server.serve(&id, PATIENT).unwrap();
            clients
                .into_iter()
                .map(|c| c.join().unwrap().unwrap())
                .collect::<Vec<_>>()
        });
        assert_eq!(got, vec![id.clone(), id.clone(), id]);
    }

    #[test]
    fn ranks_retry_until_rank_0_listens() {
        let port = free_port();
        let info = |rank| RankInfo {
            rank,
            world_size: 3,
            local_rank: rank,
            local_world_size: 3,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            launcher: Launcher::Torchrun,
        };
        let got = std::thread::scope(|s| {
            let clients: Vec<_> = (1..3)
                .map(|rank| {
                    s.spawn(move || hand_out(&info(rank), || Ok(b"unused".to_vec()), PATIENT))
                })
                .collect();
            // The clients are (most likely) already retrying against a
            // closed port; the order does not matter for correctness.
            std::thread::sleep(Duration::from_millis(50));
            let mine = hand_out(&info(0), || Ok(b"nccl-id".to_vec()), PATIENT).unwrap();
            let mut all = vec![mine];
            all.extend(clients.into_iter().map(|c| c.join().unwrap().unwrap()));
            all
        });
        assert!(got.iter().all(|p| p == b"nccl-id"), "{got:?}");
    }

    #[test]
    fn a_rank_gives_up_naming_the_address() {
        let port = free_port();
        let err = fetch_payload("127.0.0.1", port, 2, 4, Duration::from_millis(200))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("rendezvous at 127.0.0.1:{port}")),
            "{err}"
        );
        assert!(
            err.contains("rank 2 could not get the payload from rank 0"),
            "{err}"
        );
    }

    #[test]
    fn rank_0_gives_up_naming_the_missing_ranks() {
        let server = RendezvousServer::bind("127.0.0.1", 0, 3).unwrap();
        let port = server.local_addr().unwrap().port();
        let err = std::thread::scope(|s| {
            let one = s.spawn(move || fetch_payload("127.0.0.1", port, 1, 3, PATIENT));
            let err = server.serve(b"id", Duration::from_millis(300)).unwrap_err();
            assert_eq!(one.join().unwrap().unwrap(), b"id");
            err
        });
        let RuntimeError::Peer { rank, message } = &err else {
            panic!("expected a peer error, got {err}");
        };
        assert_eq!(*rank, 2);
        assert!(
            message.contains("rank 2 did not connect within"),
            "{message}"
        );
    }

    #[test]
    fn contradicting_settings_fail_both_sides() {
        let server = RendezvousServer::bind("127.0.0.1", 0, 2).unwrap();
        let port = server.local_addr().unwrap().port();
        let (server_err, client_err) = std::thread::scope(|s| {
            let client = s.spawn(move || fetch_payload("127.0.0.1", port, 1, 8, PATIENT));
            let server_err = server.serve(b"id", PATIENT).unwrap_err().to_string();
            (server_err, client.join().unwrap().unwrap_err().to_string())
        });
        assert!(
            server_err.contains("rank 1 has a world size of 8 but rank 0 has 2"),
            "{server_err}"
        );
        assert!(client_err.contains("rank 0 refused rank 1"), "{client_err}");
        let busy = RendezvousServer::bind("127.0.0.1", 0, 2).unwrap();
        let taken = busy.local_addr().unwrap().port();
        let err = RendezvousServer::bind("127.0.0.1", taken, 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("rank 0 cannot listen"), "{err}");
        let big = RendezvousServer::bind("127.0.0.1", 0, 2).unwrap();
        assert!(big.serve(&vec![0; MAX_PAYLOAD + 1], PATIENT).is_err());
    }

    #[test]
    fn a_stray_connection_does_not_stop_the_rendezvous() {
        let server = RendezvousServer::bind("127.0.0.1", 0, 2).unwrap();
        let port = server.local_addr().unwrap().port();
        std::thread::scope(|s| {
            let stray = s.spawn(move || {
                let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
                stream.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
                let mut rest = Vec::new();
                let _ = stream.read_to_end(&mut rest);
                fetch_payload("127.0.0.1", port, 1, 2, PATIENT)
            });
            server.serve(b"id", PATIENT).unwrap();
            assert_eq!(stray.join().unwrap().unwrap(), b"id");
        });
    }

    #[test]
    fn tasks_per_node_expansion() {
        assert_eq!(
            expand_tasks_per_node("V", "2(x3),1").unwrap(),
            vec![2, 2, 2, 1]
        );
        assert_eq!(expand_tasks_per_node("V", "4").unwrap(), vec![4]);
        assert!(expand_tasks_per_node("V", "").is_err());
        assert!(expand_tasks_per_node("V", "2(x3").is_err());
    }
}
