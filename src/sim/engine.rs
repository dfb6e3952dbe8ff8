//! One vLLM replica as a pure, deterministic state machine (V1-style scheduler).
//!
//! The engine never reads a clock: the caller says when a step starts
//! ([`Engine::start_step`]) and the engine answers when it ends; the caller
//! then applies the end ([`Engine::finish_step`]), which emits tokens. Between
//! the two, new requests only join the waiting queue, as in vLLM where the
//! scheduler runs once per forward pass.
//!
//! Prefix caching (`engine.enable_prefix_caching`, on by default as in
//! vLLM V1): a request that carries the identities of its prompt's full
//! blocks ([`SimRequest::prefix`]) starts its prefill after the leading
//! blocks found in the replica's [`PrefixCache`], sharing them with their
//! other holders; its own full prompt blocks are cached as they are
//! computed. A request without identities (the load generators') shares
//! nothing and runs exactly as before.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use serde::Serialize;

use super::config::{EngineConfig, SchedPolicy};
use super::metrics::{ReplicaGauges, ReplicaHistograms};
use super::prefix::PrefixCache;
use super::time::SimTime;

/// Traffic class: the thing a gate must protect versus the thing it releases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RequestClass {
    /// Latency-sensitive traffic that has an SLO.
    Interactive = 0,
    /// Work released by a dispatcher.
    Batch = 1,
}

/// A request as the pool sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct SimRequest {
    /// Unique id (caller assigned).
    pub id: u64,
    /// Traffic class.
    pub class: RequestClass,
    /// Arrival at the gateway; TTFT counts from here.
    pub arrival: SimTime,
    /// Prompt length, tokens (at least 1).
    pub prompt_tokens: u32,
    /// True output length if the model were allowed to finish (hidden from gates).
    pub output_tokens: u32,
    /// Client's `max_tokens`: generation stops here at the latest.
    pub max_tokens: u32,
    /// vLLM priority: lower runs first under the priority policy.
    pub priority: i32,
    /// Emit an event per token (HTTP streaming); otherwise only completion.
    pub stream: bool,
    /// Identities of the prompt's full KV blocks, in order, each chained
    /// on its predecessor's (`crate::prompt::blocks`); empty when the
    /// prompt's content is unknown, which caches and hits nothing.
    pub prefix: Arc<[u64]>,
}

impl SimRequest {
    /// Tokens the engine will generate: `min(output_tokens, max_tokens)`, at least 1.
    pub fn target_output(&self) -> u32 {
        self.output_tokens.min(self.max_tokens).max(1)
    }
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// All target tokens generated.
    Completed,
    /// Gateway refused with 429.
    Rejected429,
    /// Admission refused with 503.
    Rejected503,
    /// The client went away and the request was aborted.
    Aborted,
    /// Still in the pool when the run ended.
    Unfinished,
}

/// What happened to one request; the runner's unit of measurement.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestRecord {
    /// Request id.
    pub id: u64,
    /// Traffic class.
    pub class: RequestClass,
    /// Replica that served it, if routed.
    pub replica: Option<usize>,
    /// How it ended.
    pub outcome: Outcome,
    /// Arrival at the gateway.
    pub arrival: SimTime,
    /// Time of the first token.
    pub first_token_at: Option<SimTime>,
    /// Time of the last token (completion).
    pub finished_at: Option<SimTime>,
    /// Prompt length, tokens.
    pub prompt_tokens: u32,
    /// Tokens generated.
    pub output_tokens: u32,
    /// Target tokens (`min(true output, max_tokens)`).
    pub target_output_tokens: u32,
    /// Times this request was preempted (recomputed).
    pub preemptions: u32,
    /// Time from arrival until first scheduled.
    pub queue_time: Option<f64>,
    /// Mean inter-token latency, seconds.
    pub itl_mean: Option<f64>,
    /// 95th percentile of this request's inter-token latencies.
    pub itl_p95: Option<f64>,
    /// Largest inter-token gap.
    pub itl_max: Option<f64>,
}

impl RequestRecord {
    /// Time to first token, if one was produced.
    pub fn ttft(&self) -> Option<f64> {
        self.first_token_at.map(|t| t - self.arrival)
    }

    /// A record for a request that never reached an engine.
    pub fn rejected(req: &SimRequest, outcome: Outcome) -> Self {
        Self {
            id: req.id,
            class: req.class,
            replica: None,
            outcome,
            arrival: req.arrival,
            first_token_at: None,
            finished_at: None,
            prompt_tokens: req.prompt_tokens,
            output_tokens: 0,
            target_output_tokens: req.target_output(),
            preemptions: 0,
            queue_time: None,
            itl_mean: None,
            itl_p95: None,
            itl_max: None,
        }
    }
}

/// Something the engine tells the outside world at the end of a step.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// A token of a streaming request (index 0 is the first token).
    Token {
        /// Request id.
        id: u64,
        /// Zero-based index of the token.
        index: u32,
        /// Emission time.
        at: SimTime,
    },
    /// A request left the engine.
    Finished(Box<RequestRecord>),
}

/// A sequence inside the engine.
#[derive(Debug, Clone)]
struct Seq {
    req: SimRequest,
    /// Cached `req.target_output()`.
    target: u32,
    /// Tokens generated so far (survive preemption; recompute rebuilds their KV).
    generated: u32,
    /// Tokens whose KV is computed.
    computed: u32,
    /// KV blocks held privately (not in the prefix cache).
    blocks: u32,
    /// Leading prompt blocks held through the prefix cache (shared with
    /// any other sequence holding the same identities).
    shared: u32,
    /// Tokens scheduled in the step in progress (0 = not scheduled).
    scheduled: u32,
    /// Whether the scheduled work is a decode (one token after a full context).
    decoding: bool,
    first_token_at: Option<SimTime>,
    first_scheduled_at: Option<SimTime>,
    last_token_at: SimTime,
    /// Inter-token gaps, kept for the per-request p95 the SLO needs.
    itls: Vec<f32>,
    preemptions: u32,
    /// Engine arrival order, the fcfs tie-breaker.
    order: u64,
}

impl Seq {
    /// Prompt plus generated tokens: what a full prefill must cover.
    fn num_tokens(&self) -> u32 {
        self.req.prompt_tokens + self.generated
    }

    fn needed(&self) -> u32 {
        self.num_tokens() - self.computed
    }

    /// Decode = exactly the last sampled token is missing from KV.
    fn is_decode(&self) -> bool {
        self.generated > 0 && self.needed() == 1
    }

    fn record(
        &self,
        replica: usize,
        outcome: Outcome,
        finished_at: Option<SimTime>,
    ) -> RequestRecord {
        let (itl_mean, itl_p95, itl_max) = itl_summary(&self.itls);
        RequestRecord {
            id: self.req.id,
            class: self.req.class,
            replica: Some(replica),
            outcome,
            arrival: self.req.arrival,
            first_token_at: self.first_token_at,
            finished_at,
            prompt_tokens: self.req.prompt_tokens,
            output_tokens: self.generated,
            target_output_tokens: self.target,
            preemptions: self.preemptions,
            queue_time: self.first_scheduled_at.map(|t| t - self.req.arrival),
            itl_mean,
            itl_p95,
            itl_max,
        }
    }
}

fn itl_summary(itls: &[f32]) -> (Option<f64>, Option<f64>, Option<f64>) {
    if itls.is_empty() {
        return (None, None, None);
    }
    let mut v: Vec<f32> = itls.to_vec();
    v.sort_by(f32::total_cmp);
    let mean = v.iter().map(|x| f64::from(*x)).sum::<f64>() / v.len() as f64;
    let idx = ((v.len() as f64 * 0.95).ceil() as usize).clamp(1, v.len()) - 1;
    (
        Some(mean),
        Some(f64::from(v[idx])),
        v.last().map(|x| f64::from(*x)),
    )
}

/// Gives back everything `s` holds: its private blocks become free, its
/// cached ones are let go (and stay cached while free). The last block is
/// let go first, so it is evicted first, as vLLM frees a request's blocks
/// in reverse: a shorter prefix stays useful to more prompts.
fn release(cache: &mut PrefixCache, free_blocks: &mut u32, s: &mut Seq) {
    *free_blocks += s.blocks;
    for id in s.req.prefix[..s.shared as usize].iter().rev() {
        if cache.release(*id) {
            *free_blocks += 1;
        }
    }
    s.blocks = 0;
    s.shared = 0;
}

/// Caches the prompt blocks of `s` that its prefill has completed: each
/// private block becomes a cached one it holds. When an equal block was
/// cached meanwhile (another request computed it), `s` joins that one and
/// its own copy is freed.
fn cache_computed(cache: &mut PrefixCache, free_blocks: &mut u32, s: &mut Seq, block_size: u32) {
    // Prompt blocks only: generated tokens get no identity.
    let prompt_blocks = s.computed.min(s.req.prompt_tokens) / block_size;
    let full = prompt_blocks.min(u32::try_from(s.req.prefix.len()).unwrap_or(u32::MAX));
    while s.shared < full {
        // Joining a held copy frees ours; joining a free one takes it
        // out of the free space as ours goes back in (no change).
        if cache.hold_computed(s.req.prefix[s.shared as usize]) == Some(false) {
            *free_blocks += 1;
        }
        s.blocks -= 1;
        s.shared += 1;
    }
}

/// Priority-queue key: (priority, arrival bits, id). Non-negative f64 bit
/// patterns order like the numbers, so arrival sorts correctly as u64.
type PrioKey = (i32, u64, u64);

/// The waiting queue in policy order.
#[derive(Debug)]
enum WaitQueue {
    Fifo(VecDeque<Seq>),
    Prio(BTreeMap<PrioKey, Seq>),
}

impl WaitQueue {
    fn len(&self) -> usize {
        match self {
            Self::Fifo(q) => q.len(),
            Self::Prio(q) => q.len(),
        }
    }

    fn push_back(&mut self, s: Seq) {
        match self {
            Self::Fifo(q) => q.push_back(s),
            Self::Prio(q) => {
                q.insert(prio_key(&s), s);
            }
        }
    }

    /// Preempted requests go back to the head (fcfs) or to their priority place.
    fn push_front(&mut self, s: Seq) {
        match self {
            Self::Fifo(q) => q.push_front(s),
            Self::Prio(q) => {
                q.insert(prio_key(&s), s);
            }
        }
    }

    fn front(&self) -> Option<&Seq> {
        match self {
            Self::Fifo(q) => q.front(),
            Self::Prio(q) => q.values().next(),
        }
    }

    fn pop_front(&mut self) -> Option<Seq> {
        match self {
            Self::Fifo(q) => q.pop_front(),
            Self::Prio(q) => q.pop_first().map(|(_, s)| s),
        }
    }

    fn remove(&mut self, id: u64) -> Option<Seq> {
        match self {
            Self::Fifo(q) => {
                let i = q.iter().position(|s| s.req.id == id)?;
                q.remove(i)
            }
            Self::Prio(q) => {
                let key = q.iter().find(|(_, s)| s.req.id == id).map(|(k, _)| *k)?;
                q.remove(&key)
            }
        }
    }

    fn drain_all(&mut self) -> Vec<Seq> {
        match self {
            Self::Fifo(q) => q.drain(..).collect(),
            Self::Prio(q) => std::mem::take(q).into_values().collect(),
        }
    }
}

fn prio_key(s: &Seq) -> PrioKey {
    (s.req.priority, s.req.arrival.max(0.0).to_bits(), s.req.id)
}

/// The work done by one step, which sets its duration.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepWork {
    /// Prefill (and recompute) tokens in the step.
    pub prefill_tokens: u32,
    /// Decoding sequences in the step.
    pub decode_seqs: u32,
    /// Total context of the decoding sequences, tokens.
    pub decode_context: u64,
    /// Σ over prefill chunks of chunk tokens × (tokens computed before the
    /// chunk + half the chunk): the attention work of the prefill.
    pub prefill_context: u64,
}

/// Length of a jitter slot, seconds: the GPU's speed is constant within a
/// slot (the shortest step's fixed cost, so a step spans one to a few).
pub const JITTER_SLOT_S: f64 = 0.01;

/// The GPU's slowness in jitter slot `slot` of the replica seeded `seed`:
/// a step's time is its model time times this factor, uniform in
/// `[1 − jitter, 1 + jitter)`.
///
/// Why a function of time and not a stream drawn once per step: a gated run
/// takes different steps than its batch-free baseline, so a per-step stream
/// hands the same interactive request different jitter in the two runs,
/// and `ΔV` then mixes the gate's effect with noise. Drawn per (seed,
/// replica, slot), both runs see the same GPU at the same simulated time
/// whatever work is dispatched (common random numbers).
pub fn gpu_speed_factor(seed: u64, slot: u64, jitter: f64) -> f64 {
    // SplitMix64 of (seed, slot): a counter-based draw, no state to carry.
    let mut z = seed ^ slot.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    // 53 random bits to a uniform in [0, 1).
    let u = (z >> 11) as f64 / (1u64 << 53) as f64;
    1.0 + jitter * (2.0 * u - 1.0)
}

/// When a step of model duration `work` (seconds) started at `start` ends
/// on a GPU whose speed changes every [`JITTER_SLOT_S`]: within each slot
/// the step advances at `1 / gpu_speed_factor` of model time per second.
pub fn jittered_end(seed: u64, jitter: f64, start: SimTime, work: f64) -> SimTime {
    if jitter <= 0.0 {
        return start + work;
    }
    let (mut t, mut left) = (start.max(0.0), work);
    let mut slot = (t / JITTER_SLOT_S).floor() as u64;
    loop {
        let mut boundary = (slot + 1) as f64 * JITTER_SLOT_S;
        if boundary <= t {
            // Rounding put `t` on the next slot's edge.
            slot += 1;
            boundary = (slot + 1) as f64 * JITTER_SLOT_S;
        }
        let factor = gpu_speed_factor(seed, slot, jitter);
        let in_slot = (boundary - t) / factor;
        if left <= in_slot {
            return t + left * factor;
        }
        left -= in_slot;
        t = boundary;
        slot += 1;
    }
}

/// One replica: scheduler state, KV blocks, counters and histograms.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    replica: usize,
    /// Seed of this replica's GPU speed over time (see [`gpu_speed_factor`]).
    seed: u64,
    waiting: WaitQueue,
    /// Running sequences in admission order (the fcfs preemption order).
    running: Vec<Seq>,
    /// Free KV blocks, the free cached ones included (as vLLM counts
    /// them: evictable space is free space).
    free_blocks: u32,
    /// Cached prompt blocks; its free ones are part of `free_blocks`.
    cache: PrefixCache,
    /// `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits`: prompt
    /// tokens looked up and found, of requests not preempted before.
    prefix_queries_total: u64,
    prefix_hits_total: u64,
    next_order: u64,
    /// Whether a step is in progress and when it ends.
    step_end: Option<SimTime>,
    last_work: StepWork,
    steps: u64,
    preemptions_total: u64,
    prompt_tokens_total: u64,
    generation_tokens_total: u64,
    success_total: u64,
    /// Generated tokens by class: [interactive, batch].
    tokens_by_class: [u64; 2],
    /// Model time (no `c0`, no jitter) of the interactive share of every
    /// step so far, seconds: what `sluicegate eval`'s physical bound
    /// subtracts from a replica's time.
    interactive_work_s: f64,
    /// Time spent in steps that carried interactive work, seconds: while
    /// interactive requests run, the bound keeps every step within the
    /// ITL SLO.
    interactive_busy_s: f64,
    hist: ReplicaHistograms,
}

impl Engine {
    /// A fresh replica; `seed` drives only the step-time jitter, which is
    /// a function of `seed` and simulated time alone.
    pub fn new(cfg: EngineConfig, replica: usize, seed: u64) -> Self {
        let waiting = match cfg.policy {
            SchedPolicy::Fcfs => WaitQueue::Fifo(VecDeque::new()),
            SchedPolicy::Priority => WaitQueue::Prio(BTreeMap::new()),
        };
        let free_blocks = cfg.num_gpu_blocks;
        Self {
            cfg,
            replica,
            seed,
            waiting,
            running: Vec::new(),
            free_blocks,
            cache: PrefixCache::default(),
            prefix_queries_total: 0,
            prefix_hits_total: 0,
            next_order: 0,
            step_end: None,
            last_work: StepWork::default(),
            steps: 0,
            preemptions_total: 0,
            prompt_tokens_total: 0,
            generation_tokens_total: 0,
            success_total: 0,
            tokens_by_class: [0; 2],
            interactive_work_s: 0.0,
            interactive_busy_s: 0.0,
            hist: ReplicaHistograms::default(),
        }
    }

    /// The engine configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Adds a request to the waiting queue. The caller keeps
    /// `prompt + max_tokens <= max_model_len` (the pool enforces it).
    pub fn add_request(&mut self, mut req: SimRequest) {
        // Clamp defensively so an oversized request cannot wedge the engine.
        let max_len = self.cfg.max_model_len;
        req.prompt_tokens = req.prompt_tokens.clamp(1, max_len - 1);
        req.max_tokens = req.max_tokens.clamp(1, max_len - req.prompt_tokens);
        let target = req.target_output();
        let seq = Seq {
            last_token_at: req.arrival,
            req,
            target,
            generated: 0,
            computed: 0,
            blocks: 0,
            shared: 0,
            scheduled: 0,
            decoding: false,
            first_token_at: None,
            first_scheduled_at: None,
            itls: Vec::new(),
            preemptions: 0,
            order: self.next_order,
        };
        self.next_order += 1;
        self.waiting.push_back(seq);
    }

    /// Whether there is anything to schedule.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || self.waiting.len() > 0
    }

    /// End time of the step in progress, if any.
    pub fn step_end(&self) -> Option<SimTime> {
        self.step_end
    }

    /// Requests running (admitted to the batch).
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting to be admitted.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Fraction of KV blocks in use, 0–1.
    pub fn kv_usage(&self) -> f64 {
        f64::from(self.cfg.num_gpu_blocks - self.free_blocks) / f64::from(self.cfg.num_gpu_blocks)
    }

    /// Steps executed so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The work of the last step started.
    pub fn last_work(&self) -> StepWork {
        self.last_work
    }

    /// Gauges and counters in the shape the metrics use.
    pub fn gauges(&self) -> ReplicaGauges {
        ReplicaGauges {
            running: self.running.len() as u32,
            waiting: self.waiting.len() as u32,
            kv_usage: self.kv_usage(),
            preemptions_total: self.preemptions_total,
            prompt_tokens_total: self.prompt_tokens_total,
            generation_tokens_total: self.generation_tokens_total,
            success_total: self.success_total,
            prefix_cache_queries_total: self.prefix_queries_total,
            prefix_cache_hits_total: self.prefix_hits_total,
        }
    }

    /// Generated tokens so far as (interactive, batch).
    pub fn tokens_by_class(&self) -> (u64, u64) {
        (self.tokens_by_class[0], self.tokens_by_class[1])
    }

    /// `(work, busy)` of interactive requests so far, seconds: the model
    /// time of their share of each step without the fixed cost `c0`, and
    /// the time of steps that carried any of their work.
    pub fn interactive_time(&self) -> (f64, f64) {
        (self.interactive_work_s, self.interactive_busy_s)
    }

    /// Total preemptions so far.
    pub fn preemptions(&self) -> u64 {
        self.preemptions_total
    }

    /// Latency histograms with vLLM's buckets.
    pub fn histograms(&self) -> &ReplicaHistograms {
        &self.hist
    }

    /// The step duration model, without jitter.
    pub fn step_duration(&self, w: StepWork) -> f64 {
        let s = &self.cfg.step;
        (s.c0_ms
            + s.c1_ms_per_prefill_token * f64::from(w.prefill_tokens)
            + s.c2_ms_per_decode_seq * f64::from(w.decode_seqs)
            + s.c3_ms_per_context_token * w.decode_context as f64
            + s.c4_ms_per_prefill_context * w.prefill_context as f64)
            / 1000.0
    }

    fn blocks_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.cfg.block_size)
    }

    /// Takes `n` free blocks (the caller checked there are): never-cached
    /// space first, then the least recently freed cached blocks, which
    /// leave the cache. (vLLM keeps one LRU queue of all free blocks; the
    /// model spends the space that holds no prefix first.)
    fn take_blocks(&mut self, n: u32) {
        let uncached = self.free_blocks - self.cache.free_len();
        if n > uncached {
            self.cache.evict(n - uncached);
        }
        self.free_blocks -= n;
    }

    /// `(hits, free among them)`: the leading blocks of `s`'s prompt found
    /// in the cache. At least the last token is computed again (vLLM needs
    /// its logits), so a prompt that is all cached hits one block less.
    fn prefix_hits(&self, s: &Seq) -> (u32, u32) {
        if !self.cfg.enable_prefix_caching || s.req.prefix.is_empty() {
            return (0, 0);
        }
        let max = (s.num_tokens() - 1).min(s.req.prompt_tokens) / self.cfg.block_size;
        self.cache.hits(&s.req.prefix, max as usize)
    }

    /// Index of the running request to preempt, by policy.
    fn victim(&self) -> Option<usize> {
        match self.cfg.policy {
            SchedPolicy::Fcfs => self.running.len().checked_sub(1),
            SchedPolicy::Priority => self
                .running
                .iter()
                .enumerate()
                .max_by(|(_, a), (_, b)| {
                    (a.req.priority, a.req.arrival, a.order)
                        .partial_cmp(&(b.req.priority, b.req.arrival, b.order))
                        .unwrap_or(std::cmp::Ordering::Equal)
                })
                .map(|(i, _)| i),
        }
    }

    /// Preempts running[i] by recompute; returns the budget it gives back.
    fn preempt(&mut self, i: usize) -> u32 {
        let mut s = self.running.remove(i);
        let refund = s.scheduled;
        release(&mut self.cache, &mut self.free_blocks, &mut s);
        s.computed = 0;
        s.scheduled = 0;
        s.decoding = false;
        s.preemptions += 1;
        self.preemptions_total += 1;
        self.waiting.push_front(s);
        refund
    }

    /// Tries to schedule `n` tokens for running[*i], preempting others when KV
    /// is short. Returns false if running[*i] itself was preempted. `*i` is
    /// kept pointing at the same sequence when earlier ones are removed.
    fn schedule_running(&mut self, i: &mut usize, n: u32, budget: &mut u32) -> bool {
        loop {
            let s = &self.running[*i];
            let need = self
                .blocks_for(s.computed + n)
                .saturating_sub(s.blocks + s.shared);
            if need <= self.free_blocks {
                let decoding = s.is_decode();
                let s = &mut self.running[*i];
                s.blocks += need;
                s.scheduled = n;
                s.decoding = decoding;
                self.take_blocks(need);
                *budget -= n;
                return true;
            }
            let Some(v) = self.victim() else { return false };
            *budget += self.preempt(v);
            if v == *i {
                return false;
            }
            if v < *i {
                *i -= 1;
            }
        }
    }

    /// Schedules one step at `now` and returns when it ends, or `None` when idle.
    /// Must not be called while a step is in progress.
    pub fn start_step(&mut self, now: SimTime) -> Option<SimTime> {
        debug_assert!(self.step_end.is_none(), "step already in progress");
        if !self.has_work() {
            return None;
        }
        let mut budget = self.cfg.max_num_batched_tokens;
        let chunk_cap = match self.cfg.long_prefill_token_threshold {
            0 => u32::MAX,
            t => t,
        };
        let preempted_before = self.preemptions_total;

        // 1. Decodes, one token each, in admission order.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            if self.running[i].scheduled == 0
                && self.running[i].is_decode()
                && !self.schedule_running(&mut i, 1, &mut budget)
            {
                continue;
            }
            i += 1;
        }
        // 2. Partially prefilled (or recomputing) running requests.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            if s.scheduled == 0 && !s.is_decode() {
                let n = s.needed().min(budget).min(chunk_cap);
                if !self.schedule_running(&mut i, n, &mut budget) {
                    continue;
                }
            }
            i += 1;
        }
        // 3. Waiting requests, only if nothing was preempted this step (V1).
        if self.preemptions_total == preempted_before {
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs as usize {
                let Some(head) = self.waiting.front() else {
                    break;
                };
                // A waiting request has no KV (new, or preempted and
                // reset): its prefill starts after its cached blocks.
                let (hit, hit_free) = self.prefix_hits(head);
                let hit_tokens = hit * self.cfg.block_size;
                let n = (head.needed() - hit_tokens).min(budget).min(chunk_cap);
                let need = self.blocks_for(hit_tokens + n) - hit;
                // Free cached blocks it takes leave the free space too.
                if need + hit_free > self.free_blocks {
                    break;
                }
                let Some(mut s) = self.waiting.pop_front() else {
                    break;
                };
                for id in &s.req.prefix[..hit as usize] {
                    if self.cache.acquire(*id) {
                        self.free_blocks -= 1;
                    }
                }
                self.take_blocks(need);
                if self.cfg.enable_prefix_caching && s.preemptions == 0 {
                    self.prefix_queries_total += u64::from(s.num_tokens());
                    self.prefix_hits_total += u64::from(hit_tokens);
                }
                s.shared = hit;
                s.computed = hit_tokens;
                s.blocks = need;
                s.scheduled = n;
                s.decoding = false;
                s.first_scheduled_at.get_or_insert(now);
                budget -= n;
                self.running.push(s);
            }
        }

        // The step's work, and its interactive share.
        let (mut w, mut wi) = (StepWork::default(), StepWork::default());
        for s in self.running.iter().filter(|s| s.scheduled > 0) {
            let mine = [
                Some(&mut w),
                (s.req.class == RequestClass::Interactive).then_some(&mut wi),
            ];
            for x in mine.into_iter().flatten() {
                if s.decoding {
                    x.decode_seqs += 1;
                    x.decode_context += u64::from(s.computed + 1);
                } else {
                    x.prefill_tokens += s.scheduled;
                    x.prefill_context += u64::from(s.scheduled)
                        * (u64::from(s.computed) + u64::from(s.scheduled) / 2);
                }
            }
        }
        if w.decode_seqs == 0 && w.prefill_tokens == 0 {
            // Nothing fits (cannot happen with a validated config: an idle
            // engine always has room for the head request's first chunk).
            return None;
        }
        let end = jittered_end(self.seed, self.cfg.step.jitter, now, self.step_duration(w));
        if wi != StepWork::default() {
            self.interactive_work_s += self.step_duration(wi) - self.cfg.step.c0_ms / 1000.0;
            self.interactive_busy_s += end - now;
        }
        self.last_work = w;
        self.step_end = Some(end);
        self.steps += 1;
        Some(end)
    }

    /// Applies the step in progress: tokens appear at its end time.
    pub fn finish_step(&mut self, out: &mut Vec<EngineEvent>) {
        let Some(end) = self.step_end.take() else {
            return;
        };
        let mut i = 0;
        while i < self.running.len() {
            let s = &mut self.running[i];
            if s.scheduled == 0 {
                i += 1;
                continue;
            }
            s.computed += s.scheduled;
            s.scheduled = 0;
            if self.cfg.enable_prefix_caching {
                cache_computed(
                    &mut self.cache,
                    &mut self.free_blocks,
                    s,
                    self.cfg.block_size,
                );
            }
            let s = &mut self.running[i];
            if s.computed < s.num_tokens() {
                i += 1;
                continue;
            }
            // The forward pass covered everything known: one token is sampled.
            let index = s.generated;
            s.generated += 1;
            self.generation_tokens_total += 1;
            self.tokens_by_class[s.req.class as usize] += 1;
            match s.first_token_at {
                None => {
                    s.first_token_at = Some(end);
                    self.prompt_tokens_total += u64::from(s.req.prompt_tokens);
                    self.hist.ttft.observe(end - s.req.arrival);
                }
                Some(_) => {
                    let itl = end - s.last_token_at;
                    s.itls.push(itl as f32);
                    self.hist.itl.observe(itl);
                }
            }
            s.last_token_at = end;
            if s.req.stream {
                out.push(EngineEvent::Token {
                    id: s.req.id,
                    index,
                    at: end,
                });
            }
            if s.generated >= s.target {
                let mut s = self.running.remove(i);
                release(&mut self.cache, &mut self.free_blocks, &mut s);
                self.success_total += 1;
                self.hist.e2e.observe(end - s.req.arrival);
                if let Some(t) = s.first_scheduled_at {
                    self.hist.queue.observe(t - s.req.arrival);
                }
                out.push(EngineEvent::Finished(Box::new(s.record(
                    self.replica,
                    Outcome::Completed,
                    Some(end),
                ))));
                continue;
            }
            i += 1;
        }
    }

    /// Removes a request wherever it is (client gone). Work already scheduled
    /// in the current step is wasted, as in vLLM.
    pub fn abort(&mut self, id: u64) -> Option<RequestRecord> {
        if let Some(i) = self.running.iter().position(|s| s.req.id == id) {
            let mut s = self.running.remove(i);
            release(&mut self.cache, &mut self.free_blocks, &mut s);
            return Some(s.record(self.replica, Outcome::Aborted, None));
        }
        self.waiting
            .remove(id)
            .map(|s| s.record(self.replica, Outcome::Aborted, None))
    }

    /// Records of everything still inside, for the end of a run.
    pub fn drain_unfinished(&mut self) -> Vec<RequestRecord> {
        let mut out: Vec<RequestRecord> = self
            .running
            .drain(..)
            .map(|s| s.record(self.replica, Outcome::Unfinished, None))
            .collect();
        out.extend(
            self.waiting
                .drain_all()
                .into_iter()
                .map(|s| s.record(self.replica, Outcome::Unfinished, None)),
        );
        self.free_blocks = self.cfg.num_gpu_blocks;
        self.cache.clear();
        self.step_end = None;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> EngineConfig {
        let mut c = EngineConfig::default();
        c.step.jitter = 0.0;
        c
    }

    fn req(id: u64, prompt: u32, out: u32) -> SimRequest {
        SimRequest {
            id,
            class: RequestClass::Interactive,
            arrival: 0.0,
            prompt_tokens: prompt,
            output_tokens: out,
            max_tokens: 1024,
            priority: 0,
            stream: true,
            prefix: Arc::default(),
        }
    }

    /// Runs the engine until idle, returning (events, end time).
    fn run(e: &mut Engine, mut now: f64) -> (Vec<EngineEvent>, f64) {
        let mut out = Vec::new();
        while let Some(end) = e.start_step(now) {
            e.finish_step(&mut out);
            now = end;
        }
        (out, now)
    }

    fn finished(events: &[EngineEvent]) -> Vec<RequestRecord> {
        events
            .iter()
            .filter_map(|e| match e {
                EngineEvent::Finished(r) => Some((**r).clone()),
                EngineEvent::Token { .. } => None,
            })
            .collect()
    }

    #[test]
    fn batch_one_latencies_match_the_step_model() {
        let mut e = Engine::new(cfg(), 0, 1);
        e.add_request(req(1, 256, 10));
        let (ev, _) = run(&mut e, 0.0);
        let r = &finished(&ev)[0];
        // TTFT = c0 + 256 · c1 = 6.9 + 8.832 ms.
        assert!((r.ttft().unwrap() - 0.015732).abs() < 1e-9, "{r:?}");
        // ITL = c0 + c2 + c3 · ctx ≈ 6.92 ms.
        let itl = r.itl_mean.unwrap();
        assert!((0.0069..0.00695).contains(&itl), "{itl}");
        assert_eq!(r.output_tokens, 10);
        let tokens = ev
            .iter()
            .filter(|e| matches!(e, EngineEvent::Token { .. }))
            .count();
        assert_eq!(tokens, 10);
        assert_eq!(e.kv_usage(), 0.0);
    }

    #[test]
    fn long_prompt_is_prefilled_in_chunks() {
        let mut e = Engine::new(cfg(), 0, 1);
        e.add_request(req(1, 5000, 1));
        e.start_step(0.0);
        assert_eq!(e.last_work().prefill_tokens, 2048);
        let mut out = Vec::new();
        e.finish_step(&mut out);
        assert!(
            out.is_empty(),
            "no token before the prompt is fully computed"
        );
        let (ev, _) = run(&mut e, 1.0);
        assert_eq!(finished(&ev)[0].output_tokens, 1);
    }

    #[test]
    fn decodes_are_scheduled_before_new_prefill() {
        let mut e = Engine::new(cfg(), 0, 1);
        e.add_request(req(1, 100, 50));
        let end = e.start_step(0.0).unwrap();
        e.finish_step(&mut Vec::new());
        e.add_request(req(2, 4000, 5));
        e.start_step(end);
        let w = e.last_work();
        assert_eq!(w.decode_seqs, 1);
        assert_eq!(
            w.prefill_tokens, 2047,
            "the rest of the budget goes to the new prefill"
        );
    }

    #[test]
    fn max_num_seqs_bounds_the_batch() {
        let mut c = cfg();
        c.max_num_seqs = 4;
        let mut e = Engine::new(c, 0, 1);
        for id in 0..10 {
            e.add_request(req(id, 10, 100));
        }
        e.start_step(0.0);
        assert_eq!(e.num_running(), 4);
        assert_eq!(e.num_waiting(), 6);
    }

    #[test]
    fn preempts_last_admitted_when_kv_runs_out() {
        let mut c = cfg();
        c.num_gpu_blocks = 20; // 320 tokens
        c.max_model_len = 320;
        let mut e = Engine::new(c, 0, 1);
        // Two requests of 100 + 100 each need 26 blocks together at the end.
        e.add_request(req(1, 100, 100));
        e.add_request(req(2, 100, 100));
        let (ev, _) = run(&mut e, 0.0);
        let recs = finished(&ev);
        assert_eq!(recs.len(), 2);
        let r2 = recs.iter().find(|r| r.id == 2).unwrap();
        let r1 = recs.iter().find(|r| r.id == 1).unwrap();
        assert!(
            r2.preemptions > 0,
            "the later request is the victim: {r2:?}"
        );
        assert_eq!(r1.preemptions, 0);
        assert!(e.gauges().preemptions_total > 0);
        assert_eq!(r2.output_tokens, 100, "recompute keeps generated tokens");
    }

    #[test]
    fn priority_policy_admits_and_preempts_by_priority() {
        let mut c = cfg();
        c.policy = SchedPolicy::Priority;
        c.max_num_seqs = 1;
        let mut e = Engine::new(c, 0, 1);
        let mut low = req(1, 10, 3);
        low.priority = 5;
        let mut high = req(2, 10, 3);
        high.priority = 0;
        high.arrival = 0.001;
        e.add_request(low);
        e.add_request(high);
        let (ev, _) = run(&mut e, 0.01);
        let order: Vec<u64> = finished(&ev).iter().map(|r| r.id).collect();
        assert_eq!(order, vec![2, 1]);
    }

    #[test]
    fn priority_policy_preempts_the_lowest_priority_not_the_latest() {
        let mut c = cfg();
        c.policy = SchedPolicy::Priority;
        c.num_gpu_blocks = 20; // 320 tokens
        c.max_model_len = 320;
        let mut e = Engine::new(c, 0, 1);
        // The same KV squeeze as under fcfs, but the earlier request is
        // batch (priority 1) and the later one interactive (priority 0):
        // fcfs would preempt the later, priority preempts the batch one.
        let mut batch = req(1, 100, 100);
        batch.priority = 1;
        batch.class = RequestClass::Batch;
        let mut interactive = req(2, 100, 100);
        interactive.arrival = 0.001;
        e.add_request(batch);
        e.add_request(interactive);
        let (ev, _) = run(&mut e, 0.01);
        let recs = finished(&ev);
        let by_id = |id| recs.iter().find(|r| r.id == id).expect("finished");
        assert!(
            by_id(1).preemptions > 0,
            "batch is the victim: {:?}",
            by_id(1)
        );
        assert_eq!(by_id(2).preemptions, 0);
    }

    #[test]
    fn priority_policy_preempts_the_latest_arrival_among_equal_priorities() {
        let mut c = cfg();
        c.policy = SchedPolicy::Priority;
        c.num_gpu_blocks = 20;
        c.max_model_len = 320;
        let mut e = Engine::new(c, 0, 1);
        let mut first = req(1, 100, 100);
        first.priority = 3;
        let mut second = req(2, 100, 100);
        second.priority = 3;
        second.arrival = 0.001;
        e.add_request(first);
        e.add_request(second);
        let (ev, _) = run(&mut e, 0.01);
        let recs = finished(&ev);
        let by_id = |id| recs.iter().find(|r| r.id == id).expect("finished");
        assert!(by_id(2).preemptions > 0);
        assert_eq!(by_id(1).preemptions, 0);
    }

    #[test]
    fn abort_frees_kv() {
        let mut e = Engine::new(cfg(), 0, 1);
        e.add_request(req(1, 1000, 100));
        e.start_step(0.0);
        e.finish_step(&mut Vec::new());
        assert!(e.kv_usage() > 0.0);
        let rec = e.abort(1).unwrap();
        assert_eq!(rec.outcome, Outcome::Aborted);
        assert_eq!(e.kv_usage(), 0.0);
        assert!(!e.has_work());
    }

    #[test]
    fn jitter_depends_on_seed_and_time_only() {
        let j = 0.03;
        // Inside one slot: model time times that slot's factor.
        let end = jittered_end(9, j, 0.021, 0.004);
        let f = gpu_speed_factor(9, 2, j);
        assert!((end - (0.021 + 0.004 * f)).abs() < 1e-12, "{end}");
        assert!((1.0 - j..1.0 + j).contains(&f));
        // Across slots: each slot's share at its own speed.
        let end = jittered_end(9, j, 0.005, 0.010);
        let (f0, f1) = (gpu_speed_factor(9, 0, j), gpu_speed_factor(9, 1, j));
        let first = 0.005 / f0;
        let expected = 0.010 + (0.010 - first) * f1;
        assert!((end - expected).abs() < 1e-12, "{end} vs {expected}");
        // No jitter: the model time exactly.
        assert_eq!(jittered_end(9, 0.0, 1.5, 0.0125), 1.5 + 0.0125);
        // Seeds differ; the same seed and slot always give the same speed.
        assert_ne!(gpu_speed_factor(9, 5, j), gpu_speed_factor(10, 5, j));
        assert_eq!(gpu_speed_factor(9, 5, j), gpu_speed_factor(9, 5, j));
    }

    #[test]
    fn a_step_at_the_same_time_takes_as_long_whatever_ran_before() {
        // Two replicas with the same seed: one busy from time 0, one idle
        // until 5 s. The same work started at the same time on both lasts
        // exactly as long: the jitter is not a per-step stream.
        let mut c = EngineConfig::default();
        c.step.jitter = 0.1;
        let mut busy = Engine::new(c.clone(), 0, 42);
        for id in 0..20 {
            busy.add_request(req(id, 300, 20));
        }
        let (_, idle_at) = run(&mut busy, 0.0);
        assert!(busy.steps() > 10 && idle_at < 5.0);
        let mut fresh = Engine::new(c, 0, 42);
        busy.add_request(req(100, 700, 30));
        fresh.add_request(req(100, 700, 30));
        let (a, _) = run(&mut busy, 5.0);
        let (b, _) = run(&mut fresh, 5.0);
        assert_eq!(finished(&a), finished(&b));
    }

    /// A request whose prompt is `text`, its blocks cut as the HTTP front
    /// cuts them (64 characters for 16 tokens).
    fn prompted(id: u64, text: &str, out: u32) -> SimRequest {
        let tokens = u32::try_from(text.chars().count() / 4).expect("short");
        SimRequest {
            prefix: crate::prompt::blocks("m", text, 64, 512).into(),
            ..req(id, tokens, out)
        }
    }

    /// Runs `r` alone after whatever ran before; its first step's prefill.
    fn first_prefill(e: &mut Engine, r: SimRequest, now: f64) -> (u32, f64) {
        e.add_request(r);
        e.start_step(now);
        let prefill = e.last_work().prefill_tokens;
        e.finish_step(&mut Vec::new());
        let (_, end) = run(e, now + 1.0);
        (prefill, end)
    }

    #[test]
    fn a_repeated_prefix_skips_its_cached_prefill() {
        let mut e = Engine::new(cfg(), 0, 1);
        let shared = "s".repeat(1024);
        let (first, end) = first_prefill(&mut e, prompted(1, &format!("{shared}aaaa"), 5), 0.0);
        assert_eq!(first, 257);
        // 16 full shared blocks are cached; the second prompt differs only
        // in its last (partial) block.
        let (second, _) = first_prefill(&mut e, prompted(2, &format!("{shared}bbbb"), 5), end);
        assert_eq!(second, 257 - 256);
        let g = e.gauges();
        assert_eq!(g.prefix_cache_queries_total, 257 * 2);
        assert_eq!(g.prefix_cache_hits_total, 256);
        assert_eq!(e.kv_usage(), 0.0, "cached blocks are free space");
    }

    #[test]
    fn a_prompt_that_is_all_cached_computes_its_last_block_again() {
        let mut e = Engine::new(cfg(), 0, 1);
        let text = "p".repeat(512);
        let (_, end) = first_prefill(&mut e, prompted(1, &text, 3), 0.0);
        let (second, _) = first_prefill(&mut e, prompted(2, &text, 3), end);
        assert_eq!(second, 16, "the last block is recomputed for its logits");
        assert_eq!(e.gauges().prefix_cache_hits_total, 128 - 16);
    }

    #[test]
    fn a_different_first_block_misses_everything_after_it() {
        let mut e = Engine::new(cfg(), 0, 1);
        let tail = "t".repeat(960);
        let (_, end) = first_prefill(
            &mut e,
            prompted(1, &format!("{}{tail}", "a".repeat(64)), 2),
            0.0,
        );
        // Blocks 2..16 have the same text, but a block's identity carries
        // its predecessors': nothing is found.
        let (second, _) = first_prefill(
            &mut e,
            prompted(2, &format!("{}{tail}", "b".repeat(64)), 2),
            end,
        );
        assert_eq!(second, 256);
        assert_eq!(e.gauges().prefix_cache_hits_total, 0);
        assert_eq!(e.gauges().prefix_cache_queries_total, 512);
    }

    #[test]
    fn kv_pressure_evicts_the_least_recently_freed_blocks_tail_first() {
        let mut c = cfg();
        c.num_gpu_blocks = 40; // 640 tokens
        c.max_model_len = 640;
        let mut e = Engine::new(c, 0, 1);
        let a = "a".repeat(1280); // 320 tokens, 20 blocks
        let (_, end) = first_prefill(&mut e, prompted(1, &a, 1), 0.0);
        // 32 blocks for an unrelated prompt: 20 never-cached blocks are
        // free, so 12 cached blocks of `a` are evicted, its last ones.
        let (_, end) = first_prefill(&mut e, prompted(2, &"z".repeat(2048), 1), end);
        let (third, _) = first_prefill(&mut e, prompted(3, &a, 1), end);
        assert_eq!(third, 320 - 8 * 16, "the first 8 blocks survived");
        assert_eq!(e.gauges().prefix_cache_hits_total, 8 * 16);
        assert_eq!(e.kv_usage(), 0.0);
    }

    #[test]
    fn shared_blocks_are_held_once_while_both_run() {
        let mut e = Engine::new(cfg(), 0, 1);
        let shared = "s".repeat(640); // 10 blocks
        let (_, end) = first_prefill(&mut e, prompted(1, &format!("{shared}x"), 1), 0.0);
        e.add_request(prompted(2, &format!("{shared}{}", "y".repeat(64)), 50));
        e.add_request(prompted(3, &format!("{shared}{}", "z".repeat(64)), 50));
        e.start_step(end);
        e.finish_step(&mut Vec::new());
        // The 10 shared blocks are held once between them, plus each one's
        // own last block.
        let used = (e.kv_usage() * 8192.0).round() as u32;
        assert_eq!(used, 10 + 2);
        let (ev, _) = run(&mut e, end + 1.0);
        assert_eq!(finished(&ev).len(), 2);
        assert_eq!(e.kv_usage(), 0.0);
    }

    #[test]
    fn prompts_that_share_nothing_run_as_without_the_cache() {
        // (A preempted request does meet its own blocks again when it is
        // readmitted, as in vLLM; this run has no preemption.)
        let go = |texts: bool| {
            let mut c = EngineConfig {
                max_num_seqs: 4, // requests queue
                ..EngineConfig::default()
            };
            c.step.jitter = 0.1;
            let mut e = Engine::new(c, 0, 42);
            for id in 0..20u64 {
                let text: String = std::iter::repeat_n(char::from(b'a' + id as u8), 1200).collect();
                let r = if texts {
                    prompted(id, &text, 40)
                } else {
                    req(id, 300, 40)
                };
                e.add_request(r);
            }
            let (ev, end) = run(&mut e, 0.0);
            (finished(&ev), end.to_bits())
        };
        let (with, without) = (go(true), go(false));
        assert_eq!(with.0.len(), 20);
        assert_eq!(with, without);
    }

    #[test]
    fn same_seed_same_timeline() {
        let go = || {
            let mut c = EngineConfig::default();
            c.step.jitter = 0.1;
            let mut e = Engine::new(c, 0, 42);
            for id in 0..20 {
                e.add_request(req(id, 300 + id as u32 * 7, 20));
            }
            run(&mut e, 0.0).1
        };
        assert_eq!(go().to_bits(), go().to_bits());
    }
}
