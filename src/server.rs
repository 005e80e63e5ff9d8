//! `moe-node serve`: binds the HTTP API at once (so `/health` and `/ready` answer while the
//! model loads), loads the model and starts the actors on a loader thread, runs a warm-up
//! pass, then reports ready. SIGTERM (or Ctrl-C) drains: no new requests, in-flight ones
//! finish within `server.drain_seconds`, then the process exits 0.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use actix_web::{App, HttpServer, web};
use futures::future::{Either, select};

use crate::api::Phase;
use crate::api::reasoning::ReasoningFormat;
use crate::api::tool_calls::ToolCallFormat;
use crate::api::{AppState, ServedModel};
use crate::config::live::Changes;
use crate::config::{ConfigError, NodeConfig};
use crate::engine::SamplingParams;
use crate::engine::batch::SequenceEvent;
use crate::engine::grammar::Grammars;
use crate::metrics::NodeMetrics;
use crate::model::chat_template::ChatTemplate;
use crate::model::demo::{DemoSpec, write_demo_model};
use crate::model::{ModelError, Tokenizer};
use crate::node::router::{RouterState, Submit};
use crate::node::{Node, NodeError};
use crate::rollout::rebalance::rebalance_periodically;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error("writing the demo model to {dir}: {source}")]
    Demo {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("the warm-up pass failed: {0}")]
    WarmUp(String),
    #[error("the loader thread stopped unexpectedly")]
    LoaderGone,
    #[error("the HTTP server failed: {0}")]
    Http(std::io::Error),
    #[error(transparent)]
    Hub(#[from] crate::hub::HubError),
}

impl From<ModelError> for ServeError {
    fn from(e: ModelError) -> Self {
        ServeError::Node(NodeError::Model(e))
    }
}

/// Reads the configuration again, as it was read at start (SIGHUP).
pub type ConfigReader = Arc<dyn Fn() -> Result<NodeConfig, ConfigError> + Send + Sync>;

/// Runs the node until it is told to stop. Blocks the calling thread. On SIGHUP the
/// configuration is read again with `reload` and its live keys applied.
pub fn serve(config: NodeConfig, reload: ConfigReader) -> Result<(), ServeError> {
    actix_web::rt::System::new().block_on(run(config, reload))
}

async fn run(config: NodeConfig, reload: ConfigReader) -> Result<(), ServeError> {
    let listener = TcpListener::bind(config.listen_addr()).map_err(|source| ServeError::Bind {
        addr: config.server.listen.clone(),
        source,
    })?;
    let local = listener.local_addr().map_err(ServeError::Http)?;
    let drain = Duration::from_secs(config.server.drain_seconds);
    let state = web::Data::new(AppState::new(config, Arc::new(NodeMetrics::new())));
    let app_state = state.clone();
    let server =
        HttpServer::new(move || App::new().configure(crate::api::configure(app_state.clone())))
            // Streamed tokens are small writes: without TCP_NODELAY, Nagle's algorithm holds each
            // one back until the client's (delayed, up to 40 ms) ACK of the previous one.
            .on_connect(|connection, _| {
                if let Some(tcp) = connection.downcast_ref::<actix_web::rt::net::TcpStream>() {
                    let _ = tcp.set_nodelay(true);
                }
            })
            .disable_signals()
            // Generation is drained (or cut) before the server stops; this only bounds closing
            // sockets, idle keep-alive connections included.
            .shutdown_timeout(1)
            .listen(listener)
            .map_err(ServeError::Http)?
            .run();
    let handle = server.handle();
    tracing::info!("listening on http://{local}");

    let (loaded_tx, loaded_rx) = futures::channel::oneshot::channel();
    let system = actix_web::rt::System::current();
    let loader_state = state.clone();
    let loading = Arc::new(AtomicBool::new(true));
    notify_while_loading(loading.clone()).map_err(ServeError::Http)?;
    // Before the loader starts: loading may open a library that installs a SIGHUP handler of
    // its own (libucs does), and the loader then puts back the handler it found, which must
    // be ours by then. Listening from a task spawned now would race with the loader.
    let hangups = listen_for_hangups();
    std::thread::Builder::new()
        .name("moe-node-loader".into())
        .spawn(move || {
            // The device and router actors start arbiters, which need the system.
            actix_web::rt::System::set_current(system);
            let loaded = load(&loader_state, local);
            loading.store(false, Ordering::Release);
            let serving = loaded.is_ok();
            let _ = loaded_tx.send(loaded);
            if serving {
                rebalance_periodically(&loader_state.live, || {
                    loader_state.served().map(|served| served.node.rebalancer())
                });
            }
        })
        .map_err(ServeError::Http)?;
    actix_web::rt::spawn(drain_on_signal(state.clone(), handle.clone(), drain));
    actix_web::rt::spawn(reload_on_hangup(state.clone(), reload, hangups));
    if state.config.control_plane.enabled() {
        let reporting = state.clone();
        crate::control_plane::client::start(
            state.config.control_plane.clone(),
            control_plane_name(&state.config),
            state.live.clone(),
            Box::new(move || node_report(&reporting)),
        )
        .map_err(ServeError::Http)?;
    }

    let server = Box::pin(server);
    match select(server, loaded_rx).await {
        Either::Left((result, _)) => result.map_err(ServeError::Http),
        Either::Right((loaded, server)) => match loaded {
            Ok(Ok(())) => server.await.map_err(ServeError::Http),
            Ok(Err(e)) => {
                // The server future must be polled for the stop to take effect.
                let _ = futures::future::join(handle.stop(false), server).await;
                Err(e)
            }
            Err(_) => Err(ServeError::LoaderGone),
        },
    }
}

/// Loads the model, starts the actors, warms up, and puts the model in service.
fn load(state: &AppState, api: std::net::SocketAddr) -> Result<(), ServeError> {
    let started = Instant::now();
    let config = &state.config;
    crate::compute::amx::set_aside(!config.devices.cpu_amx);
    crate::compute::cpu::native_bf16::set_precision(config.devices.cpu_precision);
    let (dir, hub_name, remote) = match config.model_path() {
        Some(_) => {
            // A node of a cluster downloads the shards it reads: its dense weights and its
            // experts (the headers of all, to open the checkpoint).
            let weights = match config.model.load_format {
                crate::model::LoadFormat::Dummy => crate::hub::Weights::None,
                _ if config.cluster.enabled() => crate::hub::Weights::AsRead,
                crate::model::LoadFormat::Safetensors => crate::hub::Weights::All,
            };
            let hub = crate::hub::HubEnv::from_process();
            let found = crate::hub::resolve_model(&config.model.path, &hub, weights)?;
            (found.dir, found.name, found.remote)
        }
        None => (ensure_demo_model(&config.cache_dir())?, None, None),
    };
    let tokenizer = Tokenizer::load_optional(&dir)?;
    // A family that publishes its prompt format as code has a template built in.
    let builtin = crate::model::ModelConfig::load(&dir)
        .ok()
        .and_then(|c| c.family.builtin_chat_template());
    let mut chat_template = ChatTemplate::load(&dir, builtin)?;
    if let Some(template) = &mut chat_template {
        match std::env::current_exe() {
            Ok(exe) => template.isolate(exe),
            Err(error) => tracing::warn!(
                %error,
                "this program's path is unknown: chat templates render in-process, without \
                 a memory limit or deadline"
            ),
        }
    }
    let node = Node::start(
        &crate::model::ModelSource {
            remote,
            ..config.model_source(&dir)
        },
        config,
        state.metrics.clone(),
        api,
        &state.placements,
        &state.live,
    )?;
    tracing::info!(
        model = %dir.display(),
        model_type = %node.model.model_type,
        devices = node.devices.len(),
        replication = config.devices.replication,
        seconds = started.elapsed().as_secs_f32(),
        "model loaded"
    );
    tracing::info!(
        kernels = %crate::compute::cpu::kernel_path(),
        bf16_products = %crate::compute::cpu::native_bf16::describe(),
        "CPU kernels"
    );
    if config.batching.max_prompt_tokens >= node.model.max_position_embeddings {
        tracing::warn!(
            max_prompt_tokens = config.batching.max_prompt_tokens,
            context = node.model.max_position_embeddings,
            "batching.max_prompt_tokens is not below the model's context: prompts are limited \
             by the context (400 context_length_exceeded)"
        );
    }
    // In a cluster the warm-up needs other nodes' experts, which they may still be loading:
    // it is tried again until they answer.
    let patience = if config.cluster.enabled() {
        Duration::from_secs(config.cluster.join_timeout_seconds)
    } else {
        Duration::ZERO
    };
    crate::progress::stage("warming up (one token through every layer and device)");
    let warming = Instant::now();
    while let Err(e) = warm_up(&node) {
        if warming.elapsed() >= patience {
            return Err(e);
        }
        tracing::info!(error = %e, "warm-up waits for other nodes");
        std::thread::sleep(Duration::from_millis(500));
    }
    // A model by hub name is served under that name, as vLLM does.
    let name = if !config.model.served_name.is_empty() {
        config.model.served_name.clone()
    } else if let Some(hub_name) = &hub_name {
        hub_name.repo.clone()
    } else {
        dir.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    };
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let grammars = tokenizer.as_ref().and_then(|tokenizer| {
        Grammars::for_model(tokenizer, &node.model, state.metrics.grammar.clone())
            .map_err(
                |error| tracing::warn!(%error, "structured output is unavailable for this model"),
            )
            .ok()
    });
    let tool_format = chat_template
        .as_ref()
        .and_then(|t| ToolCallFormat::for_model(t.source(), node.model.family));
    let reasoning = chat_template
        .as_ref()
        .and_then(|t| ReasoningFormat::detect(t.source(), node.model.family));
    state.set_ready(ServedModel {
        name: name.clone(),
        node,
        tokenizer,
        chat_template,
        grammars,
        tool_format,
        reasoning,
        created,
    });
    // A reload after the join took its secrets and before now found nothing to give them to.
    apply_cluster_secrets(state);
    crate::progress::report_to_systemd(false);
    let status = format!("serving {name}");
    let _ = sd_notify::notify(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(&status),
    ]);
    // After READY=1: the watchdog's first ping is sent as its thread starts.
    watch_router(state)?;
    tracing::info!(
        model = %name,
        seconds = started.elapsed().as_secs_f32(),
        "ready"
    );
    Ok(())
}

/// How often, while loading moves, systemd's start timeout is pushed out, and by how much.
/// The unit's `TimeoutStartSec=` only has to cover the start up to the first push.
pub const EXTEND_EVERY: Duration = Duration::from_secs(20);
pub const EXTEND_BY: Duration = Duration::from_secs(60);
/// Loading that has not moved (no new stage or layer, see [`crate::progress`]) for this
/// long is stuck: the start timeout is no longer pushed out, and systemd stops the start.
/// One layer's experts, or a cluster join (bounded by `cluster.join_timeout_seconds`, at
/// most a few minutes by default), take less.
pub const STUCK_AFTER: Duration = Duration::from_secs(600);

/// Under systemd (`Type=notify`), while `loading` holds: `STATUS=` lines as the loading
/// moves (which stage, device and layer: [`crate::progress`] sends them), and
/// `EXTEND_TIMEOUT_USEC` at once and every [`EXTEND_EVERY`] as long as it moved within
/// [`STUCK_AFTER`]. Without `NOTIFY_SOCKET` there is no one to tell and no thread is started.
fn notify_while_loading(loading: Arc<AtomicBool>) -> std::io::Result<()> {
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return Ok(());
    }
    crate::progress::report_to_systemd(true);
    let extend_usec = u32::try_from(EXTEND_BY.as_micros()).unwrap_or(u32::MAX);
    std::thread::Builder::new()
        .name("moe-node-load-status".into())
        .spawn(move || {
            let mut seen = None;
            let mut moved = Instant::now();
            let mut extended: Option<Instant> = None;
            while loading.load(Ordering::Acquire) {
                let (changes, line) = crate::progress::snapshot();
                if seen != Some(changes) {
                    seen = Some(changes);
                    moved = Instant::now();
                }
                if extended.is_none_or(|at| at.elapsed() >= EXTEND_EVERY) {
                    extended = Some(Instant::now());
                    if moved.elapsed() < STUCK_AFTER {
                        let _ = sd_notify::notify(&[sd_notify::NotifyState::ExtendTimeoutUsec(
                            extend_usec,
                        )]);
                    } else {
                        tracing::warn!(
                            stuck_seconds = moved.elapsed().as_secs(),
                            at = %line,
                            "loading has not moved; the start timeout is no longer extended"
                        );
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            crate::progress::report_to_systemd(false);
        })
        .map(|_| ())
}

/// This node's name at the control plane: `control_plane.node_name`, else
/// `cluster.node_id`, else the host name.
fn control_plane_name(config: &NodeConfig) -> String {
    [&config.control_plane.node_name, &config.cluster.node_id]
        .into_iter()
        .find(|n| !n.is_empty())
        .cloned()
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_string())
                .filter(|h| !h.is_empty())
        })
        .unwrap_or_else(|| "node".into())
}

/// How the node is now, for the control plane.
fn node_report(state: &AppState) -> crate::control_plane::wire::Report {
    let mut report = crate::control_plane::wire::Report {
        version: env!("CARGO_PKG_VERSION").into(),
        phase: match state.phase() {
            Phase::Loading => "loading",
            Phase::Ready => "ready",
            Phase::Draining => "draining",
        }
        .into(),
        in_flight: state.in_flight(),
        placement_version: state.placements.current().map(|p| p.version()),
        ..Default::default()
    };
    if let Some(served) = state.served() {
        let node = &served.node;
        report.model = served.name.clone();
        report.model_fingerprint = format!("{:016x}", node.model_fingerprint());
        let alive = node.experts.devices_alive();
        report.devices = alive.len();
        report.devices_up = alive.iter().filter(|&&up| up).count();
        report.imbalance = (0..node.load.num_layers())
            .filter(|&l| node.model.moe_layers[l])
            .map(|l| node.load.recent(l).0.imbalance())
            .fold(0.0, f64::max);
    }
    report
}

/// On SIGHUP: reads the configuration again and applies its live keys
/// ([`crate::config::live::LIVE_KEYS`]); other changed keys are logged as needing a
/// restart. A configuration that is not valid changes nothing. Once serving, systemd is
/// told `RELOADING=1` (with `MONOTONIC_USEC`) before and `READY=1` after (sd_notify(3)).
async fn reload_on_hangup(state: web::Data<AppState>, reload: ConfigReader, hangups: Hangups) {
    #[cfg(unix)]
    {
        // Registered at start, so that a SIGHUP while loading does not end the process.
        let mut hangups = match hangups {
            Ok(hangups) => hangups,
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGHUP; reloading is not possible");
                return;
            }
        };
        let mut in_force = state.config.clone();
        while hangups.recv().await.is_some() {
            let serving = state.phase() == Phase::Ready;
            if serving {
                let mut said = vec![sd_notify::NotifyState::Reloading];
                if let Ok(now) = sd_notify::NotifyState::monotonic_usec_now() {
                    said.push(now);
                }
                let _ = sd_notify::notify(&said);
            }
            let read = reload.clone();
            match web::block(move || read()).await {
                Ok(Ok(new)) => {
                    apply_reload(&state, &in_force, &new);
                    in_force = new;
                }
                Ok(Err(e)) => tracing::error!(
                    "reload refused, the node keeps its settings: {}",
                    e.to_string().replace('\n', " ")
                ),
                Err(e) => tracing::error!(error = %e, "reload failed, the node keeps its settings"),
            }
            if serving {
                let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = (state, reload, hangups);
    }
}

/// SIGHUP as the node listens for it (see [`reload_on_hangup`]).
#[cfg(unix)]
type Hangups = std::io::Result<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Hangups = ();

#[cfg(unix)]
fn listen_for_hangups() -> Hangups {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
}

#[cfg(not(unix))]
fn listen_for_hangups() -> Hangups {}

/// Applies the live keys of `new` (the settings in force being `in_force`) and says what
/// changed and what waits for a restart.
fn apply_reload(state: &AppState, in_force: &NodeConfig, new: &NodeConfig) {
    let changes = Changes::between(&state.config, in_force, new);
    state.live.apply(new);
    apply_cluster_secrets(state);
    if let Err(error) = crate::logging::set_filter(&new.logging.filter) {
        tracing::warn!(%error, "logging.filter not applied");
    }
    if !changes.need_restart.is_empty() {
        tracing::warn!(
            keys = %changes.need_restart.join(", "),
            "changed keys need a restart to take effect; the node runs with their old values until then"
        );
    }
    tracing::info!(
        applied = %if changes.applied.is_empty() {
            "nothing".to_string()
        } else {
            changes.applied.join(", ")
        },
        api_keys = state.live.api_key_count(),
        "configuration reloaded"
    );
}

/// Hands the cluster secrets as last read
/// ([`LiveSettings::cluster_secrets`](crate::config::live::LiveSettings::cluster_secrets)) to gossip, which
/// seals with the first and opens with these only from its next datagram, and to the peer
/// handshake: a secret removed from the configuration is refused at once. While the node
/// loads, the join takes them from there; once it serves, the loader calls this again, so a
/// reload between the join and then is applied too.
fn apply_cluster_secrets(state: &AppState) {
    if !state.config.cluster.enabled() {
        return;
    }
    let Some(joined) = state
        .served()
        .and_then(|served| served.node.cluster.as_ref())
    else {
        tracing::info!("cluster.secrets: the node is still loading; it joins with these");
        return;
    };
    let secrets = state.live.cluster_secrets();
    if let Err(error) = joined.membership.set_keys(&secrets) {
        tracing::error!(%error, "cluster.secrets not applied to gossip");
    }
    // The peer handshake proves and accepts only the secrets read now (a secret removed is
    // refused from the next handshake on).
    joined.set_peer_secrets(&secrets);
}

/// Exit status when the router is gone (sysexits' EX_SOFTWARE): systemd restarts the node.
pub const EXIT_ROUTER_GONE: i32 = 70;

/// Watches the router actor: if it stops (a panic in a step ends its thread) or stalls (one
/// step runs past [`crate::node::stall_limit`]), the node can serve nothing, so it leaves
/// `/ready` and exits non-zero for its supervisor to restart it while the other nodes of a
/// cluster go on serving.
fn watch_router(state: &AppState) -> Result<(), ServeError> {
    let Some(served) = state.served() else {
        return Ok(());
    };
    let router = served.node.router.clone();
    // Under systemd with `WatchdogSec=`, a ping at a quarter of the interval while the router
    // steps (or idles): a wedged process, this thread included, is restarted by systemd.
    let watchdog = sd_notify::watchdog_enabled().map(|interval| interval / 4);
    std::thread::Builder::new()
        .name("moe-node-watchdog".into())
        .spawn(move || {
            let mut pinged = Instant::now();
            if watchdog.is_some() {
                let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
            }
            loop {
                match router.state() {
                    RouterState::Running => {
                        if let Some(every) = watchdog
                            && pinged.elapsed() >= every
                        {
                            let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
                            pinged = Instant::now();
                        }
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    RouterState::Stopped => {
                        tracing::error!(
                            "the router stopped (a step panicked or its thread ended): exiting so that the node is restarted"
                        );
                        break;
                    }
                    RouterState::Stalled(running) => {
                        tracing::error!(
                            seconds = running.as_secs(),
                            "the router is stuck in one step: exiting so that the node is restarted"
                        );
                        break;
                    }
                }
            }
            std::process::exit(EXIT_ROUTER_GONE);
        })
        .map(|_| ())
        .map_err(ServeError::Http)
}

/// One token through every layer and device, so the first request does not pay for cold
/// caches and a broken device shows up before the node says it is ready.
fn warm_up(node: &Node) -> Result<(), ServeError> {
    let submit = Submit {
        stop_at_eos: false,
        ..Submit::new(vec![0], 1, SamplingParams::default())
    };
    let mut events = futures::executor::block_on(node.router.submit(submit))
        .map_err(|e| ServeError::WarmUp(e.to_string()))?;
    loop {
        match events.blocking_recv() {
            Some(
                SequenceEvent::Token { .. }
                | SequenceEvent::PromptLogprobs(_)
                | SequenceEvent::Degraded { .. },
            ) => {}
            Some(SequenceEvent::Finished { .. }) => return Ok(()),
            Some(SequenceEvent::Failed(e)) => return Err(ServeError::WarmUp(e.to_string())),
            None => return Err(ServeError::WarmUp("the router stopped".into())),
        }
    }
}

/// The demo model's directory under `cache_dir`, written there on first use. It is written
/// into a temporary directory and renamed, so an interrupted write is never mistaken for a
/// model.
fn ensure_demo_model(cache_dir: &Path) -> Result<PathBuf, ServeError> {
    let spec = DemoSpec::default();
    let dir = cache_dir.join("demo-model");
    if dir.join("config.json").exists() {
        if crate::model::demo::refresh_demo_tokenizer(&dir)? {
            tracing::info!(dir = %dir.display(), "the demo model's tokenizer and chat template were updated");
        }
        return Ok(dir);
    }
    let demo_error = |source| ServeError::Demo {
        dir: dir.clone(),
        source,
    };
    std::fs::create_dir_all(cache_dir).map_err(demo_error)?;
    let partial = cache_dir.join(format!("demo-model.partial-{}", std::process::id()));
    tracing::info!(
        "writing the demo model ({} experts, top-{}) to {}",
        spec.num_experts,
        spec.top_k,
        dir.display()
    );
    crate::progress::stage("writing the demo model");
    write_demo_model(&partial, &spec, |done, total| {
        crate::progress::layer(done.saturating_sub(1), total);
        tracing::info!("demo model: layer {done}/{total} written");
    })?;
    match std::fs::rename(&partial, &dir) {
        Ok(()) => Ok(dir),
        // Another node process on this machine wrote it first.
        Err(_) if dir.join("config.json").exists() => {
            let _ = std::fs::remove_dir_all(&partial);
            Ok(dir)
        }
        Err(e) => Err(demo_error(e)),
    }
}

/// On SIGTERM or SIGINT: stop admitting, wait for in-flight generations (at most `drain`),
/// then stop the HTTP server gracefully.
async fn drain_on_signal(
    state: web::Data<AppState>,
    handle: actix_web::dev::ServerHandle,
    drain: Duration,
) {
    wait_for_signal().await;
    state.start_draining();
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    // Every generation a client asked for holds an in-flight guard until its response is
    // fully sent, which outlasts its sequence in the router.
    let in_flight = || state.in_flight();
    tracing::info!(
        in_flight = in_flight(),
        drain_seconds = drain.as_secs(),
        "draining"
    );
    // `server.drain_seconds` is bounded by validation; a day stands in should it not be.
    let deadline = Instant::now()
        .checked_add(drain)
        .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400));
    while in_flight() > 0 && Instant::now() < deadline {
        actix_web::rt::time::sleep(Duration::from_millis(20)).await;
    }
    if in_flight() > 0 {
        tracing::warn!(
            in_flight = in_flight(),
            "drain time is up; ending the requests in flight with an error"
        );
        state.cut_in_flight();
        // Their last events are written; a client that does not read them is not waited for.
        let flushed = Instant::now() + Duration::from_secs(1);
        while in_flight() > 0 && Instant::now() < flushed {
            actix_web::rt::time::sleep(Duration::from_millis(10)).await;
        }
    } else {
        tracing::info!("drained");
    }
    handle.stop(true).await;
}

#[cfg(unix)]
async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            let term = Box::pin(term.recv());
            let int = Box::pin(int.recv());
            select(term, int).await;
        }
        _ => {
            tracing::error!("cannot listen for signals; stop the node with SIGKILL");
            futures::future::pending::<()>().await;
        }
    }
}

#[cfg(not(unix))]
async fn wait_for_signal() {
    let _ = tokio::signal::ctrl_c().await;
}
