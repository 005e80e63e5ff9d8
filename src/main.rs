//! `moe-node` command line: parses arguments and calls the library.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{CommandFactory, Parser, Subcommand};
use moe_node::compute::cuda::{self, CudaError};
use moe_node::config::{ConfigError, ConfigSources, ENV_PREFIX, LogFormat, NodeConfig};
use moe_node::engine::gpu::engine_on_gpu;
use moe_node::engine::{Engine, EngineError, GenerateRequest, SamplingParams, generate};
use moe_node::experts::device::{DeviceChoice, choose_devices};
use moe_node::experts::gpu::LoadError;
use moe_node::hub::{HubError, Weights};
use moe_node::logging::ClientMistakes;
use moe_node::model::demo::{DemoSpec, write_demo_model};
use moe_node::model::template_worker;
use moe_node::model::{LoadFormat, ModelConfig, ModelError, ModelSource, Tokenizer};
use moe_node::node::NodeError;
use moe_node::server::{ConfigReader, ServeError, serve};

mod plan_cli;

#[derive(Parser)]
#[command(
    name = "moe-node",
    version,
    about = "Serve large Mixture-of-Experts models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a model over HTTP (OpenAI-compatible API). With no model configured, serves the
    /// built-in demo model, written into the cache directory on first start.
    Serve(ServeArgs),
    /// Validate a configuration file: exit 0, or 78 with every problem listed.
    Check {
        /// The configuration file (TOML), e.g. etc/moe-node.toml.
        #[arg(long)]
        config: PathBuf,
    },
    /// Show where experts would run: the GPUs and CUDA libraries found (compiling the
    /// kernels for each GPU into the cache), or why the CPU would be used. Exit 78 when
    /// `devices.backend = "cuda"` and no GPU is usable.
    Devices {
        /// Configuration file (TOML); without one, defaults and MOE_NODE_* variables apply.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Generate a continuation of a prompt with a local model and print it.
    Generate(GenerateArgs),
    /// Write the built-in demo model (Kimi K3-shaped, 896 experts, top-16) to a directory.
    DemoModel {
        /// Directory to write config.json, model.safetensors and the tokenizer into.
        #[arg(long)]
        out: PathBuf,
        /// Bias the gate so that expert activations follow a Zipf-like law with this
        /// exponent (0: no bias; 1: strongly skewed).
        #[arg(long, default_value_t = 0.0)]
        skew: f64,
    },
    /// Run a control plane that nodes register with and heartbeat to (`[control_plane]` in
    /// their config): desired state per cluster, node reports, a status page at /.
    ControlPlane {
        /// The control plane's configuration (TOML): listen, database, token hashes.
        #[arg(long)]
        config: PathBuf,
    },
    /// Run a gateway: the OpenAI API in front of a cluster, holding no model. It learns the
    /// nodes from the cluster's gossip, forwards each request to one of them, and moves a
    /// stream whose node dies, stalls or drains to another node without a gap.
    Gateway {
        /// Configuration file (TOML): [server], [cluster] (secrets, gossip_listen, seeds),
        /// [gateway]; e.g. etc/examples/local-cluster/gateway.toml.
        #[arg(long)]
        config: PathBuf,
        /// Address to listen on (overrides server.listen).
        #[arg(long)]
        listen: Option<String>,
    },
    /// Print shell completions to stdout (the packages install them).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff) to stdout (the packages install it as moe-node(1)).
    #[command(hide = true)]
    Manual,
    /// Renders chat templates for a serving node (started by it; see
    /// `moe_node::model::template_worker`).
    #[command(name = "chat-template-worker", hide = true)]
    ChatTemplateWorker,
    /// Deployment-readiness report (no GPU, no weights needed): where the experts go for a
    /// cluster shape, what each node failure costs, how imbalanced the devices are under
    /// an activation profile. Exit 0 when ready, 1 listing every problem, 78 for bad input.
    Plan(PlanArgs),
    /// Save a serving node's activation profile (`GET /admin/experts?format=profile`) to a
    /// file, for `plan --profile`.
    Profile {
        /// The node's HTTP address, e.g. http://127.0.0.1:8080.
        #[arg(long)]
        url: String,
        #[arg(long)]
        out: PathBuf,
        /// Counts since the node started instead of over the recent window.
        #[arg(long)]
        since_start: bool,
        /// API key, when the node requires one (server.api_keys).
        #[arg(long)]
        api_key: Option<String>,
    },
}

#[derive(clap::Args)]
struct PlanArgs {
    /// Model directory (config.json is enough), or a Hugging Face name `org/name[@revision]`.
    #[arg(long)]
    model: PathBuf,
    /// Node configuration (TOML): replication, spare slots, on_expert_unavailable.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Nodes in the cluster.
    #[arg(long, default_value_t = 1)]
    nodes: usize,
    /// Devices (GPUs, or CPU slots) per node.
    #[arg(long, default_value_t = 1)]
    devices_per_node: usize,
    /// Copies of every expert (default: cluster.replication with several nodes,
    /// devices.replication with one).
    #[arg(long)]
    replication: Option<usize>,
    /// Spare expert slots per device and MoE layer for hot-expert copies (default:
    /// placement.redundant_slots_per_device).
    #[arg(long)]
    redundant_slots: Option<usize>,
    /// Expert weights (MiB) one placement version of a rebalance loads at most; 0: no
    /// bound (default: placement.max_move_mib).
    #[arg(long)]
    max_move_mib: Option<f64>,
    /// Activation profile (`moe-node profile`, or /admin/experts?format=profile).
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Memory of each device in GiB: does everything fit?
    #[arg(long)]
    device_memory_gib: Option<f64>,
    /// Devices per node holding a replica of the dense part and a KV cache, the first ones;
    /// 0: every device (default: devices.dense_replicas).
    #[arg(long)]
    dense_replicas: Option<usize>,
    /// Largest imbalance (most loaded device / mean) the verdict accepts.
    #[arg(long, default_value_t = 2.0)]
    max_imbalance: f64,
    /// Ready even where one node failing leaves experts without a copy (the risk is still
    /// reported); also `cluster.accept_unavailable_on_failure` in the configuration.
    #[arg(long)]
    accept_unavailable_on_failure: bool,
    /// Print one JSON object instead of the readable report.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Configuration file (TOML); without one, defaults and MOE_NODE_* variables apply.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Model directory, or a Hugging Face name `org/name[@revision]` found in the Hugging
    /// Face cache and downloaded into it when missing (overrides model.path).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Address to listen on, e.g. 0.0.0.0:8080 (overrides server.listen).
    #[arg(long)]
    listen: Option<String>,
    /// How the weights are read (overrides model.load_format): `dummy` makes random bf16
    /// weights from the model directory's config.json alone.
    #[arg(long, value_enum)]
    load_format: Option<LoadFormat>,
    /// Serve only the first N decoder layers (overrides model.num_layers).
    #[arg(long, value_name = "N")]
    num_layers: Option<usize>,
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// Model directory: config.json, safetensors weights, optionally tokenizer.json; or a
    /// Hugging Face name `org/name[@revision]`.
    #[arg(long)]
    model: PathBuf,
    /// Prompt text (needs tokenizer.json).
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids, e.g. 5,17,42.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Number of tokens to generate.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop at the end-of-sequence token the model config names.
    #[arg(long)]
    stop_at_eos: bool,
    /// Print one JSON object: token_ids, last_logits and (with a tokenizer) text.
    #[arg(long)]
    json: bool,
    /// Run the model on GPU N (bf16 weights): the routed experts and the dense part.
    #[arg(long, value_name = "N")]
    gpu: Option<usize>,
    /// With --gpu, keep the dense part (attention, norms, lm head) on the CPU.
    #[arg(long, requires = "gpu")]
    dense_on_cpu: bool,
    /// With --gpu, run on this many GPUs emulated on the CPU (4 GiB each): the GPU code
    /// path, kernels included, slowly, where there is no GPU (needs g++).
    #[arg(long, value_name = "N", requires = "gpu")]
    emulated_gpus: Option<usize>,
    /// How the weights are read: `dummy` makes random bf16 weights from config.json alone.
    #[arg(long, value_enum, default_value_t = LoadFormat::Safetensors)]
    load_format: LoadFormat,
    /// Run only the first N decoder layers.
    #[arg(long, value_name = "N")]
    num_layers: Option<usize>,
}

/// Exit status for a model directory that is not usable (sysexits' EX_CONFIG, EX_DATAERR).
const EXIT_CONFIG: u8 = 78;
const EXIT_DATA: u8 = 65;

fn init_logging(format: LogFormat) {
    init_logging_filtered(format, "", &Default::default(), "");
}

/// Logging with `logging.filter` (empty: `RUST_LOG`, else info); the filter can be changed
/// later through `moe_node::logging::set_filter` (a reload). With
/// `telemetry.otlp_endpoint`, spans are exported as OpenTelemetry traces too (`node` names
/// this process in them).
fn init_logging_filtered(
    format: LogFormat,
    filter: &str,
    telemetry: &moe_node::config::TelemetryConfig,
    node: &str,
) {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(moe_node::logging::filter_for(filter))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    // A malformed request is the client's mistake: INFO, at most once a minute.
    let traces = match format {
        LogFormat::Text => {
            let builder = builder
                .event_format(ClientMistakes::new(tracing_subscriber::fmt::format()))
                .with_filter_reloading();
            let handle = builder.reload_handle();
            moe_node::logging::install_filter_reload(Box::new(move |f| {
                handle.reload(f).map_err(|e| e.to_string())
            }));
            let subscriber = builder.finish();
            let traces = moe_node::telemetry::layer(telemetry, node);
            let (layer, traces) = split(traces);
            subscriber.with(layer).init();
            traces
        }
        LogFormat::Json => {
            let builder = builder
                .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
                .event_format(ClientMistakes::new(
                    tracing_subscriber::fmt::format().json(),
                ))
                .with_filter_reloading();
            let handle = builder.reload_handle();
            moe_node::logging::install_filter_reload(Box::new(move |f| {
                handle.reload(f).map_err(|e| e.to_string())
            }));
            let subscriber = builder.finish();
            let traces = moe_node::telemetry::layer(telemetry, node);
            let (layer, traces) = split(traces);
            subscriber.with(layer).init();
            traces
        }
    };
    match traces {
        Err(error) => tracing::error!(%error, "traces are not exported"),
        Ok(true) => tracing::info!(
            endpoint = %telemetry.otlp_endpoint,
            sample_ratio = telemetry.sample_ratio,
            "exporting traces over OTLP"
        ),
        Ok(false) => {}
    }
}

/// The traces layer to install, and whether there is one (or why it could not be made).
fn split<L>(made: Result<Option<L>, String>) -> (Option<L>, Result<bool, String>) {
    match made {
        Ok(layer) => {
            let on = layer.is_some();
            (layer, Ok(on))
        }
        Err(error) => (None, Err(error)),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Linux grants the AMX tile state to a whole process on request; asked before any thread
    // exists, so that no thread's signal stack can be too small for it.
    moe_node::compute::amx::status();
    let result = match cli.command {
        // Serving logs in the configured format, so it starts logging once the config is read.
        Command::Serve(args) => run_serve(args),
        Command::Check { config } => run_check(config),
        Command::Devices { config } => {
            init_logging(LogFormat::Text);
            run_devices(config)
        }
        Command::Generate(mut args) => {
            init_logging(LogFormat::Text);
            let weights = match args.load_format {
                LoadFormat::Dummy => Weights::None,
                LoadFormat::Safetensors => Weights::All,
            };
            match model_dir(&args.model, weights) {
                Ok(dir) => {
                    args.model = dir;
                    run_generate(args)
                }
                Err(e) => Err(e),
            }
        }
        Command::DemoModel { out, skew } => {
            init_logging(LogFormat::Text);
            run_demo_model(out, skew)
        }
        Command::ControlPlane { config } => {
            init_logging(LogFormat::Text);
            run_control_plane(config)
        }
        Command::Gateway { config, listen } => run_gateway(config, listen),
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "moe-node",
                &mut std::io::stdout(),
            );
            Ok(())
        }
        Command::Manual => clap_mangen::Man::new(Cli::command())
            .render(&mut std::io::stdout())
            .context("writing the manual page"),
        Command::ChatTemplateWorker => {
            template_worker::serve(std::io::stdin().lock(), std::io::stdout().lock())
                .map_err(anyhow::Error::msg)
        }
        Command::Plan(mut args) => {
            // A model by hub name: its config is all a plan reads.
            let planned = model_dir(&args.model, Weights::None).and_then(|dir| {
                args.model = dir;
                plan_cli::run(&args)
            });
            match planned {
                Ok(true) => Ok(()),
                Ok(false) => return ExitCode::from(1),
                Err(e) => Err(e),
            }
        }
        Command::Profile {
            url,
            out,
            since_start,
            api_key,
        } => plan_cli::save_profile(&url, &out, since_start, api_key.as_deref()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => report(e),
    }
}

/// `--model` or `model.path`: a directory, or a Hugging Face name found in its cache (and
/// downloaded into it, with as much of the weights as `weights` says).
fn model_dir(model: &Path, weights: Weights) -> anyhow::Result<PathBuf> {
    let hub = moe_node::hub::HubEnv::from_process();
    Ok(moe_node::hub::resolve_model(&model.to_string_lossy(), &hub, weights)?.dir)
}

/// Prints the error and maps it to an exit status.
fn report(e: anyhow::Error) -> ExitCode {
    // The chain of causes, less those a message already quotes.
    let mut message = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !message.contains(&cause) {
            message = format!("{message}: {cause}");
        }
    }
    eprintln!("error: {message}");
    if let Some(hub) = e.chain().find_map(|c| c.downcast_ref::<HubError>()) {
        // A name, cache or token to fix; a file that came wrong; else the network.
        return ExitCode::from(match hub {
            hub if hub.is_configuration() => EXIT_CONFIG,
            HubError::Checksum { .. } | HubError::Size { .. } | HubError::BadIndex { .. } => {
                EXIT_DATA
            }
            _ => 1,
        });
    }
    if e.chain().any(|c| {
        c.downcast_ref::<ConfigError>().is_some()
            || c.downcast_ref::<moe_node::plan::PlanError>().is_some()
            || cuda_error(c).is_some_and(CudaError::is_deployment_problem)
    }) {
        return ExitCode::from(EXIT_CONFIG);
    }
    let model_error = e.chain().find_map(|c| {
        c.downcast_ref::<ModelError>()
            .or_else(|| match c.downcast_ref::<LoadError>() {
                Some(LoadError::Model(m)) => Some(m),
                _ => None,
            })
            .or_else(|| match c.downcast_ref::<EngineError>() {
                Some(EngineError::Model(m)) => Some(m),
                _ => None,
            })
    });
    ExitCode::from(match model_error {
        Some(ModelError::Config { .. }) => EXIT_CONFIG,
        Some(_) => EXIT_DATA,
        None => 1,
    })
}

/// The CUDA error `c` is or wraps (a GPU load error is transparent, so the chain skips it).
fn cuda_error<'a>(c: &'a (dyn std::error::Error + 'static)) -> Option<&'a CudaError> {
    c.downcast_ref::<CudaError>()
        .or(match c.downcast_ref::<LoadError>() {
            Some(LoadError::Cuda(e)) => Some(e),
            _ => None,
        })
}

/// The process's `MOE_NODE_*` variables, for the config's environment layer.
/// The environment the configuration reads: `MOE_NODE_*`, and systemd's
/// `CREDENTIALS_DIRECTORY` (see `moe_node::config::CREDENTIALS`).
fn node_env() -> HashMap<String, String> {
    std::env::vars()
        .filter(|(k, _)| k.starts_with(&format!("{ENV_PREFIX}_")) || k == "CREDENTIALS_DIRECTORY")
        .collect()
}

fn run_check(path: PathBuf) -> anyhow::Result<()> {
    let config = NodeConfig::load(ConfigSources {
        file: Some(&path),
        env: node_env(),
        overrides: Vec::new(),
    })?;
    if let Some(model) = config.model_path() {
        ModelConfig::load(&model_dir(&model, Weights::None)?)?;
    }
    for warning in config.warnings() {
        eprintln!("warning: {warning}");
    }
    println!("{}: ok", path.display());
    Ok(())
}

fn run_devices(path: Option<PathBuf>) -> anyhow::Result<()> {
    let config = NodeConfig::load(ConfigSources {
        file: path.as_deref(),
        env: node_env(),
        overrides: Vec::new(),
    })?;
    // The dense part and CPU slots run these; a GPU node's router too where the dense part
    // stays on the CPU.
    moe_node::compute::amx::set_aside(!config.devices.cpu_amx);
    moe_node::compute::cpu::native_bf16::set_precision(config.devices.cpu_precision);
    println!("CPU kernels: {}", moe_node::compute::cpu::kernel_path());
    println!(
        "CPU products with bf16 weights: {}",
        moe_node::compute::cpu::native_bf16::describe()
    );
    let runtime = match choose_devices(&config.devices) {
        Ok(DeviceChoice::Gpus(runtime)) => runtime,
        Ok(DeviceChoice::Cpu {
            slots,
            no_gpu: None,
        }) => {
            println!("experts run on {slots} CPU slots (devices.backend = \"cpu\")");
            return Ok(());
        }
        Ok(DeviceChoice::Cpu {
            slots,
            no_gpu: Some(reason),
        }) => {
            println!("no usable GPU: {reason}");
            println!("experts run on {slots} CPU slots");
            return Ok(());
        }
        Err(LoadError::Cuda(e)) => return Err(e).context("devices.backend = \"cuda\""),
        Err(e) => return Err(e.into()),
    };
    for lib in &runtime.libraries {
        println!("{}: {}", lib.what, lib.path.display());
    }
    let (major, minor) = runtime.nvrtc_version;
    println!(
        "driver API {}.{}, NVRTC {major}.{minor}",
        runtime.driver_version / 1000,
        runtime.driver_version % 1000 / 10
    );
    let cache = config.cache_dir().join("kernels");
    let mut archs: Vec<String> = Vec::new();
    for gpu in &runtime.gpus {
        println!(
            "GPU {}: {}, {}, {:.1} GiB",
            gpu.ordinal,
            gpu.name,
            gpu.sm(),
            gpu.total_bytes as f64 / (1u64 << 30) as f64
        );
        if !archs.contains(&gpu.sm()) {
            archs.push(gpu.sm());
        }
    }
    for arch in &archs {
        for kernel in cuda::kernels::ALL {
            let started = Instant::now();
            let compiled = cuda::kernels::load(kernel, arch, Some(&cache))?;
            println!(
                "kernels/{} for {arch}: {} ({} KiB, {} ms) in {}",
                kernel.file,
                match compiled.origin {
                    cuda::kernels::Origin::Compiled => "compiled",
                    cuda::kernels::Origin::Cached => "cached",
                },
                compiled.cubin.len() / 1024,
                started.elapsed().as_millis(),
                cache.display()
            );
        }
    }
    println!(
        "experts run on {} GPUs; the dense part on GPU 0{}",
        runtime.gpus.len(),
        if config.devices.dense_on_gpu {
            ""
        } else {
            " (no: devices.dense_on_gpu = false, it runs on the CPU)"
        }
    );
    Ok(())
}

fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut overrides = Vec::new();
    if let Some(model) = &args.model {
        overrides.push(("model.path", model.display().to_string().into()));
    }
    if let Some(listen) = &args.listen {
        overrides.push(("server.listen", listen.clone().into()));
    }
    if let Some(format) = args.load_format {
        overrides.push((
            "model.load_format",
            format!("{format:?}").to_lowercase().into(),
        ));
    }
    if let Some(layers) = args.num_layers {
        overrides.push(("model.num_layers", (layers as u64).into()));
    }
    let config = NodeConfig::load(ConfigSources {
        file: args.config.as_deref(),
        env: node_env(),
        overrides: overrides.clone(),
    })?;
    init_logging_filtered(
        config.logging.format,
        &config.logging.filter,
        &config.telemetry,
        &config.cluster.node_id,
    );
    for warning in config.warnings() {
        tracing::warn!("{warning}");
    }
    // On SIGHUP: the same layers read again (the file, the environment, the credentials).
    let file = args.config.clone();
    let reload: ConfigReader = Arc::new(move || {
        NodeConfig::load(ConfigSources {
            file: file.as_deref(),
            env: node_env(),
            overrides: overrides.clone(),
        })
    });
    let served = serve(config, reload);
    // The spans not sent yet go before the process does.
    moe_node::telemetry::shutdown();
    match served {
        Ok(()) => {
            tracing::info!("stopped");
            Ok(())
        }
        // Model problems keep their own exit status.
        Err(ServeError::Node(NodeError::Model(e))) => Err(e.into()),
        Err(ServeError::Hub(e)) => Err(e.into()),
        Err(e) => Err(e.into()),
    }
}

fn run_gateway(path: PathBuf, listen: Option<String>) -> anyhow::Result<()> {
    // A gateway places no experts: the node-only keys that validation checks against each
    // other are set to what is always valid, whatever the file says.
    let mut overrides = vec![
        ("cluster.expect_nodes", 1u64.into()),
        ("cluster.replication", 1u64.into()),
    ];
    if let Some(listen) = listen {
        overrides.push(("server.listen", listen.into()));
    }
    let config = NodeConfig::load(ConfigSources {
        file: Some(&path),
        env: node_env(),
        overrides,
    })?;
    init_logging_filtered(
        config.logging.format,
        &config.logging.filter,
        &config.telemetry,
        &config.cluster.node_id,
    );
    let ran = moe_node::gateway::run(config);
    moe_node::telemetry::shutdown();
    ran?;
    tracing::info!("gateway stopped");
    Ok(())
}

fn run_control_plane(path: PathBuf) -> anyhow::Result<()> {
    let config = moe_node::control_plane::ControlPlaneConfig::load(&path)?;
    moe_node::control_plane::server::run(config)?;
    tracing::info!("control plane stopped");
    Ok(())
}

fn run_generate(args: GenerateArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let source = ModelSource {
        dir: args.model.clone(),
        load_format: args.load_format,
        num_layers: args.num_layers,
        remote: None,
    };
    let engine = match args.gpu {
        None => Engine::load_source(&source)?,
        Some(ordinal) => {
            if let Some(count) = args.emulated_gpus {
                moe_node::compute::cuda::emulated_runtime(moe_node::compute::cuda::EmulatedGpus {
                    count,
                    bytes: 4 << 30,
                })?;
            }
            let engine = engine_on_gpu(&source, ordinal, !args.dense_on_cpu, None, None)?;
            if let Ok(runtime) = moe_node::compute::cuda::runtime(None) {
                moe_node::compute::cuda::log_runtime(runtime);
            }
            engine
        }
    };
    let tokenizer = Tokenizer::load_optional(&args.model)?;
    tracing::info!(
        model = %args.model.display(),
        model_type = %engine.config().model_type,
        seconds = started.elapsed().as_secs_f32(),
        "model loaded"
    );
    let prompt = match (&args.prompt, args.prompt_ids) {
        (_, Some(ids)) => ids,
        (Some(text), None) => match &tokenizer {
            Some(t) => t.encode(text)?,
            None => bail!(
                "{} has no tokenizer.json: give the prompt as token ids with --prompt-ids",
                args.model.display()
            ),
        },
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    let generation = generate(
        &engine,
        &GenerateRequest {
            prompt,
            max_tokens: args.max_tokens,
            sampling: SamplingParams {
                temperature: args.temperature,
                top_p: args.top_p,
                seed: args.seed,
                ..SamplingParams::default()
            },
            stop_at_eos: args.stop_at_eos,
        },
    )?;
    let text = tokenizer
        .as_ref()
        .map(|t| t.decode(&generation.token_ids))
        .transpose()?;
    if args.json {
        let mut out = serde_json::json!({
            "token_ids": generation.token_ids,
            "last_logits": generation.last_logits,
        });
        if let Some(text) = text {
            out["text"] = text.into();
        }
        println!("{out}");
    } else {
        match text {
            Some(text) => println!("{text}"),
            None => println!(
                "{}",
                generation
                    .token_ids
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        }
    }
    Ok(())
}

fn run_demo_model(out: PathBuf, skew: f64) -> anyhow::Result<()> {
    if !skew.is_finite() || !(0.0..=4.0).contains(&skew) {
        bail!("--skew {skew}: give an exponent between 0 and 4 (1 is strongly skewed)");
    }
    let spec = DemoSpec {
        skew,
        ..DemoSpec::default()
    };
    write_demo_model(&out, &spec, |done, total| {
        tracing::info!("demo model: layer {done}/{total} written");
    })
    .with_context(|| format!("writing the demo model to {}", out.display()))?;
    tracing::info!(
        "demo model written to {}: kimi_k2 layout, {} experts, {} active",
        out.display(),
        spec.num_experts,
        spec.top_k
    );
    Ok(())
}
