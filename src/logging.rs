//! Log output: text or JSON lines on stderr. A malformed request (a parse error, a URI too
//! long, a connection cut mid-request) is the client's mistake, which actix-http logs at
//! ERROR; here it is written at INFO, at most once a minute, with a count of those left
//! out, so that any client cannot fill the log with errors.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// How often a client's mistake is written at most.
pub const CLIENT_MISTAKE_EVERY: Duration = Duration::from_secs(60);

/// Wraps an event format: events from the HTTP connection layer at ERROR are written at
/// INFO, rate-limited; everything else as `inner` writes it.
pub struct ClientMistakes<F> {
    inner: F,
    last: Mutex<Option<Instant>>,
    left_out: AtomicU64,
}

impl<F> ClientMistakes<F> {
    pub fn new(inner: F) -> Self {
        ClientMistakes {
            inner,
            last: Mutex::new(None),
            left_out: AtomicU64::new(0),
        }
    }

    /// Whether this one is written (the first, or the first after a quiet minute).
    fn due(&self, now: Instant) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        match *last {
            Some(at) if now.duration_since(at) < CLIENT_MISTAKE_EVERY => false,
            _ => {
                *last = Some(now);
                true
            }
        }
    }
}

/// An event actix-http logs about one connection: the client's doing.
fn is_client_mistake(event: &Event<'_>) -> bool {
    let meta = event.metadata();
    *meta.level() == Level::ERROR && meta.target().starts_with("actix_http::h1")
}

impl<S, N, F> FormatEvent<S, N> for ClientMistakes<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        if !is_client_mistake(event) {
            return self.inner.format_event(ctx, writer, event);
        }
        if !self.due(Instant::now()) {
            self.left_out.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let mut line = String::new();
        self.inner
            .format_event(ctx, Writer::new(&mut line), event)?;
        // The level is the first `ERROR` of a text line and the `"level":"ERROR"` of JSON.
        let mut line = line.replacen("ERROR", " INFO", 1).replacen(
            "\"level\":\" INFO\"",
            "\"level\":\"INFO\"",
            1,
        );
        let left_out = self.left_out.swap(0, Ordering::Relaxed);
        if left_out > 0 {
            let end = line.trim_end_matches('\n').len();
            let note = format!(" (a client's mistake; {left_out} more since the last one written)");
            if line.trim_end().ends_with('}') {
                // JSON: the note goes in as a field.
                let close = line[..end].rfind('}').unwrap_or(end);
                line.insert_str(close, &format!(",\"left_out\":{left_out}"));
            } else {
                line.insert_str(end, &note);
            }
        }
        writer.write_str(&line)
    }
}

/// Replaces the log filter of the running process (installed by `main` once logging is up).
type SetFilter = Box<dyn Fn(tracing_subscriber::EnvFilter) -> Result<(), String> + Send + Sync>;

static SET_FILTER: std::sync::OnceLock<SetFilter> = std::sync::OnceLock::new();

/// The filter `logging.filter` asks for: itself when set, else `RUST_LOG`, else "info".
/// A filter that does not parse (validation refuses it before this) falls back to "info".
pub fn filter_for(configured: &str) -> tracing_subscriber::EnvFilter {
    use tracing_subscriber::EnvFilter;
    if configured.is_empty() {
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"))
    } else {
        EnvFilter::builder()
            .parse(configured)
            .unwrap_or_else(|_| EnvFilter::new("info"))
    }
}

/// Lets [`set_filter`] change the filter from now on.
pub fn install_filter_reload(set: SetFilter) {
    let _ = SET_FILTER.set(set);
}

/// Applies `logging.filter` to the running process (see [`filter_for`]).
pub fn set_filter(configured: &str) -> Result<(), String> {
    match SET_FILTER.get() {
        Some(set) => set(filter_for(configured)),
        None => Err("this process's log filter cannot be changed".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::Arc;

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_flood_of_client_mistakes_is_one_info_line() {
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .event_format(ClientMistakes::new(tracing_subscriber::fmt::format()))
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            for _ in 0..100 {
                tracing::error!(target: "actix_http::h1::dispatcher", "stream error: bad request");
            }
            tracing::error!(target: "moe_node::server", "a real error");
        });
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(
            lines[0].contains(" INFO ") && lines[0].contains("stream error"),
            "{text}"
        );
        assert!(!lines[0].contains("ERROR"), "{text}");
        assert!(
            lines[1].contains("ERROR") && lines[1].contains("a real error"),
            "{text}"
        );
    }
}
