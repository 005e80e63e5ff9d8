//! OpenTelemetry traces over OTLP (`[telemetry] otlp_endpoint`). The node's tracing spans
//! become OpenTelemetry spans (through `tracing-opentelemetry`), sent in batches by the
//! exporter's own thread as OTLP/HTTP protobuf. A generation request is one trace:
//!
//! ```text
//! request                      (the API: one per generation request)
//!   step                       (a router step the sequence took part in)
//!     dispatch                 (one MoE layer's expert work)
//!       peer_call              (the rows sent to one other node, until its reply)
//!         expert_call          (on that node: parented by the trace context the frame
//!                               carries, exported by that node)
//! ```
//!
//! A step serves every sequence in the batch: it is the child of one traced sequence's
//! request and links to the others'. With telemetry off, none of these spans is made.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::trace::{
    SpanContext, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider as _,
};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing::Subscriber;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::registry::LookupSpan;

use crate::config::TelemetryConfig;
use crate::transport::wire::TraceContext;

static ON: AtomicBool = AtomicBool::new(false);
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// Whether spans are exported: the places that make spans only for traces ask this first.
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// The layer that exports this process's spans as `config` says (`None` when it is off),
/// for the subscriber `main` builds; `node` names this process in the spans' resource.
pub fn layer<S>(
    config: &TelemetryConfig,
    node: &str,
) -> Result<Option<impl tracing_subscriber::Layer<S>>, String>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    if config.otlp_endpoint.is_empty() {
        return Ok(None);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(config.otlp_endpoint.clone())
        .with_timeout(std::time::Duration::from_secs(10))
        .build()
        .map_err(|e| format!("telemetry.otlp_endpoint: {e}"))?;
    let mut resource =
        opentelemetry_sdk::Resource::builder().with_service_name(config.service_name.clone());
    if !node.is_empty() {
        resource = resource.with_attribute(opentelemetry::KeyValue::new(
            "service.instance.id",
            node.to_string(),
        ));
    }
    // A request's spans follow its sampling, and so do a remote call's: the parent decides.
    let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(config.sample_ratio)));
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(sampler)
        .with_resource(resource.build())
        .build();
    let tracer = provider.tracer("moe-node");
    let _ = PROVIDER.set(provider);
    ON.store(true, Ordering::Relaxed);
    Ok(Some(tracing_opentelemetry::layer().with_tracer(tracer)))
}

/// Sends the spans not sent yet and stops the exporter (at exit).
pub fn shutdown() {
    if let Some(provider) = PROVIDER.get()
        && let Err(error) = provider.shutdown()
    {
        tracing::warn!(%error, "the last spans could not be exported");
    }
}

/// `span`'s context for a peer frame: `None` when it is not recorded (telemetry off, or
/// the trace not sampled).
pub fn context_of(span: &tracing::Span) -> Option<TraceContext> {
    if !enabled() {
        return None;
    }
    let context = span.context();
    let span_context = context.span().span_context().clone();
    (span_context.is_valid() && span_context.is_sampled()).then(|| TraceContext {
        trace_id: span_context.trace_id().to_bytes(),
        span_id: span_context.span_id().to_bytes(),
        flags: span_context.trace_flags().to_u8(),
    })
}

/// Whether `span` is recorded in a sampled trace.
pub fn sampled(span: &tracing::Span) -> bool {
    enabled() && span.context().span().span_context().is_sampled()
}

/// The span `make` makes (a child of the current span) when the current span is recorded
/// in a sampled trace; none otherwise, so that work outside a traced request starts no
/// trace of its own.
pub fn child_of_current(make: impl FnOnce() -> tracing::Span) -> tracing::Span {
    if enabled() && sampled(&tracing::Span::current()) {
        make()
    } else {
        tracing::Span::none()
    }
}

/// Makes `span` the child of the remote span `parent` (work another node asked for).
pub fn set_remote_parent(span: &tracing::Span, parent: TraceContext) {
    let parent = SpanContext::new(
        TraceId::from_bytes(parent.trace_id),
        opentelemetry::trace::SpanId::from_bytes(parent.span_id),
        TraceFlags::new(parent.flags),
        true,
        TraceState::default(),
    );
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(parent));
}

/// The span a W3C `traceparent` header names (`00-<trace id>-<span id>-<flags>`, in
/// lowercase hex); `None` for any other text, or an all-zero id.
pub fn parse_traceparent(header: &str) -> Option<TraceContext> {
    let mut parts = header.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |text: &str, out: &mut [u8]| -> Option<()> {
        if text.len() != out.len() * 2
            || !text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            return None;
        }
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(())
    };
    // Version 00 has exactly four parts; a later version may add more.
    if version == "ff" || (version == "00" && parts.next().is_some()) {
        return None;
    }
    let mut version_byte = [0u8; 1];
    hex(version, &mut version_byte)?;
    let mut encoded = Vec::with_capacity(crate::transport::wire::TRACE_LEN);
    let mut trace_id = [0u8; 16];
    let mut span_id = [0u8; 8];
    let mut flag = [0u8; 1];
    hex(trace, &mut trace_id)?;
    hex(span, &mut span_id)?;
    hex(flags, &mut flag)?;
    encoded.extend_from_slice(&trace_id);
    encoded.extend_from_slice(&span_id);
    encoded.push(flag[0]);
    TraceContext::decode(&encoded)
}

/// Links `span` to `other`'s span (a step to the requests it served besides its parent's).
pub fn link(span: &tracing::Span, other: &tracing::Span) {
    span.add_link(other.context().span().span_context().clone());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_header_is_read_as_w3c_trace_context_says() {
        let parsed =
            parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(parsed.trace_id[..2], [0x4b, 0xf9]);
        assert_eq!(parsed.span_id[7], 0xb7);
        assert_eq!(parsed.flags, 1);
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        ] {
            assert_eq!(parse_traceparent(bad), None, "{bad:?}");
        }
    }
}
