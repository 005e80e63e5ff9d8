//! One request through the gateway: sent to a node ([`open`], trying others while nodes
//! refuse it or cannot be reached), then relayed back. A stream of one choice is relayed
//! event by event, the gateway keeping the token ids the client has been sent; when its
//! node dies (the connection closes without `[DONE]`), stalls (nothing for
//! `gateway.stall_seconds`, or gossip declares it down), or hands it off while draining (an
//! error event), the gateway sends the request to another node with those ids
//! (`resume_token_ids`) and relays the rest: no gap, no token twice, the same `id`. A
//! stream of several choices is split into one such stream per choice ([`super::choices`]).
//! A whole response is read whole, and asked again of another node if its node fails first.

use std::time::{Duration, Instant};

use actix_web::HttpResponse;
use actix_web::web::{self, Bytes};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use super::Gateway;
use super::nodes::Lease;
use crate::api::{ApiError, DEGRADED_HEADER, HANDOFF_HEADER};

/// A request as the client sent it, and what relaying it needs.
pub struct Asked {
    /// `/v1/chat/completions` or `/v1/completions`.
    pub path: &'static str,
    body: Map<String, Value>,
    /// The prompt's text (or the messages as JSON), for prefix affinity.
    prefix: Vec<u8>,
    /// The client's `Authorization`, passed on (nodes may check keys too).
    pub authorization: Option<String>,
    /// The client's W3C `traceparent`, passed on: the node's spans join the client's trace.
    pub traceparent: Option<String>,
    stream: bool,
    /// A stream the gateway can move to another node: of one choice, or of up to
    /// [`super::choices::MAX_SPLIT`] split into one stream per choice.
    movable: bool,
    /// `n`: the choices asked for.
    choices: u64,
    /// The client asked for `return_token_ids` itself.
    wants_ids: bool,
}

impl Asked {
    /// Reads a generation request enough to route it; the nodes validate the rest.
    pub fn parse(
        path: &'static str,
        bytes: &[u8],
        authorization: Option<String>,
    ) -> Result<Asked, ApiError> {
        let body: Map<String, Value> = crate::api::parse_json(bytes)?;
        let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
        let choices = match body.get("n") {
            None | Some(Value::Null) => Some(1),
            Some(n) => n.as_u64().filter(|&n| n >= 1),
        };
        // Choice `i` of a split stream asks with seed `seed + i`: a seed that is not a
        // number of 64 bits is the node's to refuse, unsplit.
        let seed_splits = body.get("seed").is_none_or(|s| s.as_u64().is_some());
        let prefix = match (body.get("messages"), body.get("prompt")) {
            (Some(messages), _) => messages.to_string().into_bytes(),
            (None, Some(Value::String(text))) => text.clone().into_bytes(),
            (None, Some(other)) => other.to_string().into_bytes(),
            (None, None) => Vec::new(),
        };
        let movable = stream
            && !body.contains_key("resume_token_ids")
            && match choices {
                Some(1) => true,
                Some(n) => n <= super::choices::MAX_SPLIT && seed_splits,
                None => false,
            };
        let mut asked = Asked {
            path,
            wants_ids: body.get("return_token_ids") == Some(&Value::Bool(true)),
            body,
            prefix,
            authorization,
            traceparent: None,
            stream,
            movable,
            choices: choices.unwrap_or(1),
        };
        if asked.movable {
            // Sampled without a seed, a stream moved to another node would draw from
            // another seed there: choose one now, so that it draws what it would have.
            if !asked.body.contains_key("seed") {
                asked
                    .body
                    .insert("seed".into(), json!(rand::random::<u32>()));
            }
            asked.body.insert("return_token_ids".into(), json!(true));
        }
        Ok(asked)
    }

    /// One movable stream per choice: choice `i` with `n = 1` and seed `seed + i`, as a
    /// node seeds the choices of one request.
    pub(super) fn split(&self) -> Vec<Asked> {
        let seed = self.body.get("seed").and_then(Value::as_u64).unwrap_or(0);
        (0..self.choices)
            .map(|i| {
                let mut body = self.body.clone();
                body.insert("n".into(), json!(1));
                body.insert("seed".into(), json!(seed.wrapping_add(i)));
                Asked {
                    path: self.path,
                    body,
                    prefix: self.prefix.clone(),
                    authorization: self.authorization.clone(),
                    traceparent: self.traceparent.clone(),
                    stream: true,
                    movable: true,
                    choices: 1,
                    wants_ids: self.wants_ids,
                }
            })
            .collect()
    }

    /// The body a node gets, going on after `sent` (tokens the client already has).
    fn body_after(&self, sent: &[u64]) -> Vec<u8> {
        let mut body = self.body.clone();
        if !sent.is_empty() {
            body.insert("resume_token_ids".into(), json!(sent));
        }
        Value::Object(body).to_string().into_bytes()
    }
}

/// A node's answer that is passed on as it is (a client error, or every node refusing).
pub(super) struct Refusal {
    status: u16,
    content_type: Option<String>,
    body: Bytes,
}

impl Refusal {
    pub(super) fn into_response(self) -> HttpResponse {
        let status = actix_web::http::StatusCode::from_u16(self.status)
            .unwrap_or(actix_web::http::StatusCode::BAD_GATEWAY);
        let mut response = HttpResponse::build(status);
        if let Some(content_type) = self.content_type {
            response.content_type(content_type);
        }
        response.body(self.body)
    }

    /// The error event a stream ends with when this refusal ends it.
    fn event(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| {
            ApiError::unavailable(String::from_utf8_lossy(&self.body).into_owned()).body()
        })
    }
}

/// A node answering 200, and the node.
pub(super) struct Upstream {
    lease: Lease,
    response: reqwest::Response,
}

impl Upstream {
    /// The node's degraded-answer header, if it sent one.
    pub(super) fn degraded(&self) -> Option<reqwest::header::HeaderValue> {
        self.response.headers().get(DEGRADED_HEADER).cloned()
    }
}

/// Sends `asked` (after `sent`) to a ready node not in `avoid` while there are others,
/// trying the next while nodes cannot be reached or answer 429, 502, 503 or 504 (each
/// then goes into `avoid`). A node's other answers are the request's: passed on. While no
/// node is ready (the moments a placement change catches up, or every node restarts) it
/// waits up to `gateway.wait_ready_seconds` for one.
pub(super) async fn open(
    gateway: &Gateway,
    asked: &Asked,
    sent: &[u64],
    avoid: &mut Vec<String>,
) -> Result<Result<Upstream, Refusal>, ApiError> {
    let body = asked.body_after(sent);
    let mut refused = None;
    let config = &gateway.config.gateway;
    let wait_until = Instant::now() + Duration::from_secs(config.wait_ready_seconds);
    let mut tries = 0;
    while tries <= config.max_moves {
        let Some(lease) = gateway.nodes.choose(&asked.prefix, avoid) else {
            if refused.is_none() && Instant::now() < wait_until {
                tokio::time::sleep(Duration::from_millis(config.ready_poll_ms.min(100))).await;
                continue;
            }
            break;
        };
        tries += 1;
        let mut request = gateway
            .client
            .post(format!("http://{}{}", lease.api, asked.path))
            .header("content-type", "application/json")
            .body(body.clone());
        if let Some(authorization) = &asked.authorization {
            request = request.header("authorization", authorization);
        }
        if let Some(traceparent) = &asked.traceparent {
            request = request.header("traceparent", traceparent);
        }
        if asked.movable {
            request = request.header(HANDOFF_HEADER, "1");
        }
        let response = match request.send().await {
            Ok(response) => response,
            Err(error) => {
                tracing::warn!(node = %lease.node, %error, "node unreachable: trying another");
                gateway.metrics.moved("unreachable");
                gateway.nodes.unreachable(&lease.node);
                avoid.push(lease.node.clone());
                continue;
            }
        };
        let status = response.status().as_u16();
        if status == 200 {
            tracing::debug!(node = %lease.node, why = lease.why, "forwarded");
            return Ok(Ok(Upstream { lease, response }));
        }
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = response.bytes().await.unwrap_or_default();
        let refusal = Refusal {
            status,
            content_type,
            body,
        };
        if ![429, 502, 503, 504].contains(&status) {
            return Ok(Err(refusal));
        }
        tracing::info!(node = %lease.node, status, "node refused: trying another");
        avoid.push(lease.node.clone());
        refused = Some(refusal);
    }
    match refused {
        Some(refusal) => Ok(Err(refusal)),
        None => Err(ApiError::unavailable(
            "no node of the cluster is ready (the gateway learns them from gossip)",
        )),
    }
}

/// Forwards one generation request and relays its answer.
pub async fn forward(gateway: web::Data<Gateway>, asked: Asked) -> Result<HttpResponse, ApiError> {
    if asked.movable && asked.choices > 1 {
        return Ok(match super::choices::forward(gateway, asked).await? {
            Ok((receiver, degraded)) => event_stream(receiver, degraded),
            Err(refusal) => refusal.into_response(),
        });
    }
    let mut avoid = Vec::new();
    let upstream = match open(&gateway, &asked, &[], &mut avoid).await? {
        Ok(upstream) => upstream,
        Err(refusal) => return Ok(refusal.into_response()),
    };
    if !asked.stream {
        return whole(gateway, asked, upstream, avoid).await;
    }
    let degraded = upstream.degraded();
    let (sender, receiver) = mpsc::channel::<Bytes>(64);
    if asked.movable {
        actix_web::rt::spawn(relay_events(
            gateway.clone(),
            asked,
            upstream,
            avoid,
            sender,
        ));
    } else {
        actix_web::rt::spawn(relay_bytes(upstream, sender));
    }
    Ok(event_stream(receiver, degraded))
}

/// The client's response: the events `receiver` gets, and the node's degraded-answer
/// header.
fn event_stream(
    receiver: mpsc::Receiver<Bytes>,
    degraded: Option<reqwest::header::HeaderValue>,
) -> HttpResponse {
    let body = futures::stream::unfold(receiver, |mut receiver| async move {
        let bytes = receiver.recv().await?;
        Some((Ok::<_, actix_web::Error>(bytes), receiver))
    });
    let mut response = HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("Cache-Control", "no-cache"))
        .streaming(body);
    if let Some(degraded) = degraded {
        response.headers_mut().insert(
            actix_web::http::header::HeaderName::from_static(DEGRADED_HEADER),
            actix_web::http::header::HeaderValue::from_bytes(degraded.as_bytes())
                .unwrap_or(actix_web::http::header::HeaderValue::from_static("1")),
        );
    }
    response
}

/// A stream that cannot move (more choices than are split, or a seed that cannot be): its
/// bytes as they come.
async fn relay_bytes(mut upstream: Upstream, sender: mpsc::Sender<Bytes>) {
    while let Ok(Some(bytes)) = upstream.response.chunk().await {
        if sender.send(bytes).await.is_err() {
            return;
        }
    }
}

/// How relaying from one node ended.
enum End {
    /// `[DONE]` went to the client.
    Done,
    /// The client went away.
    ClientGone,
    /// The node failed the stream: why (a metric's label), and its error event if it sent
    /// one.
    Failed(&'static str, Option<Value>),
}

/// What a stream has sent its client so far.
#[derive(Default)]
struct Sent {
    ids: Vec<u64>,
    /// The first node's `id` and `created`, kept by every later chunk.
    id: Option<(Value, Value)>,
    /// Its choice has a finish reason.
    finished: bool,
    /// It has moved at least once: the next node's opening chunk is not sent again.
    moved: bool,
}

/// Relays a stream of one choice, moving it to another node whenever its node fails it.
pub(super) async fn relay_events(
    gateway: web::Data<Gateway>,
    asked: Asked,
    mut upstream: Upstream,
    mut avoid: Vec<String>,
    sender: mpsc::Sender<Bytes>,
) {
    let mut sent = Sent::default();
    let mut moves = 0;
    loop {
        let (why, error) = match pump(&gateway, &asked, &mut upstream, &mut sent, &sender).await {
            End::Done => {
                gateway
                    .metrics
                    .request(if moves > 0 { "moved" } else { "ok" });
                return;
            }
            End::ClientGone => return,
            End::Failed(why, error) => (why, error),
        };
        if sent.finished {
            // Only the usage and `[DONE]` were missing.
            let _ = sender.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
            return;
        }
        moves += 1;
        let node = upstream.lease.node.clone();
        if moves > gateway.config.gateway.max_moves {
            tracing::warn!(%node, why, moves, "a stream failed on every node it moved to");
            gateway.metrics.request("failed");
            let error = error.unwrap_or_else(|| {
                ApiError::unavailable(format!(
                    "the stream failed on {moves} nodes (gateway.max_moves)"
                ))
                .body()
            });
            end_with(&sender, &error).await;
            return;
        }
        let said = error.as_ref().map(|e| e["error"]["message"].to_string());
        tracing::warn!(%node, why, said, tokens = sent.ids.len(), "moving a stream to another node");
        gateway.metrics.moved(why);
        avoid.push(node);
        match open(&gateway, &asked, &sent.ids, &mut avoid).await {
            Ok(Ok(next)) => {
                upstream = next;
                sent.moved = true;
            }
            Ok(Err(refusal)) => {
                end_with(&sender, &refusal.event()).await;
                return;
            }
            Err(error) => {
                end_with(&sender, &error.body()).await;
                return;
            }
        }
    }
}

async fn end_with(sender: &mpsc::Sender<Bytes>, error: &Value) {
    let _ = sender.send(Bytes::from(format!("data: {error}\n\n"))).await;
    let _ = sender.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
}

/// How often a relay looks at its node when it sends nothing.
const TICK: Duration = Duration::from_millis(250);

/// Relays the events of one node until the stream ends or the node fails it.
async fn pump(
    gateway: &Gateway,
    asked: &Asked,
    upstream: &mut Upstream,
    sent: &mut Sent,
    sender: &mpsc::Sender<Bytes>,
) -> End {
    let stall = Duration::from_secs(gateway.config.gateway.stall_seconds);
    let mut buffer: Vec<u8> = Vec::new();
    let mut heard = Instant::now();
    loop {
        let bytes = match tokio::time::timeout(TICK, upstream.response.chunk()).await {
            Err(_) => {
                if heard.elapsed() > stall {
                    return End::Failed("stalled", None);
                }
                if !gateway.nodes.is_up(&upstream.lease.node) {
                    return End::Failed("down", None);
                }
                continue;
            }
            Ok(Err(_)) => return End::Failed("cut", None),
            Ok(Ok(None)) => return End::Failed("closed", None),
            Ok(Ok(Some(bytes))) => bytes,
        };
        heard = Instant::now();
        buffer.extend_from_slice(&bytes);
        while let Some(at) = buffer.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buffer.drain(..at + 2).collect();
            if let Some(end) = relay_event(asked, &event, sent, sender).await {
                return end;
            }
        }
    }
}

/// One server-sent event of a node: passed on as the client's (its `id` the first node's,
/// its token ids only if asked for), or the end of the stream.
async fn relay_event(
    asked: &Asked,
    event: &[u8],
    sent: &mut Sent,
    sender: &mpsc::Sender<Bytes>,
) -> Option<End> {
    let text = String::from_utf8_lossy(event);
    let data = text.lines().find_map(|line| line.strip_prefix("data: "))?;
    if data == "[DONE]" {
        let gone = sender
            .send(Bytes::from_static(b"data: [DONE]\n\n"))
            .await
            .is_err();
        return Some(if gone { End::ClientGone } else { End::Done });
    }
    let Ok(mut chunk) = serde_json::from_str::<Value>(data) else {
        return Some(End::Failed("garbled", None));
    };
    if chunk.get("error").is_some() {
        return Some(End::Failed("error", Some(chunk)));
    }
    let choice = chunk["choices"].get_mut(0);
    if let Some(choice) = choice {
        if sent.moved && choice["delta"].get("role").is_some() {
            return None;
        }
        if let Some(ids) = choice["token_ids"].as_array() {
            sent.ids.extend(ids.iter().filter_map(Value::as_u64));
        }
        if !choice["finish_reason"].is_null() {
            sent.finished = true;
        }
        if !asked.wants_ids
            && let Some(choice) = choice.as_object_mut()
        {
            choice.remove("token_ids");
        }
    }
    match &sent.id {
        None => sent.id = Some((chunk["id"].clone(), chunk["created"].clone())),
        Some((id, created)) => {
            chunk["id"] = id.clone();
            chunk["created"] = created.clone();
        }
    }
    let gone = sender
        .send(Bytes::from(format!("data: {chunk}\n\n")))
        .await
        .is_err();
    gone.then_some(End::ClientGone)
}

/// A whole response: read to its end, and asked of another node if its node fails first
/// (the client has had none of it, so starting over loses nothing).
async fn whole(
    gateway: web::Data<Gateway>,
    asked: Asked,
    mut upstream: Upstream,
    mut avoid: Vec<String>,
) -> Result<HttpResponse, ApiError> {
    let mut moves = 0;
    loop {
        let degraded = upstream.response.headers().get(DEGRADED_HEADER).cloned();
        let why = match read_whole(&gateway, &mut upstream).await {
            Ok(body) => {
                // A node that fails after its first byte ends the body with an error.
                let failed = serde_json::from_slice::<Value>(&body)
                    .map_or(true, |v| v.get("error").is_some());
                if !failed {
                    gateway
                        .metrics
                        .request(if moves > 0 { "moved" } else { "ok" });
                    let mut response = HttpResponse::Ok();
                    response.content_type("application/json");
                    if let Some(degraded) = degraded {
                        response.insert_header((DEGRADED_HEADER, degraded.as_bytes()));
                    }
                    return Ok(response.body(body));
                }
                "error"
            }
            Err(why) => why,
        };
        moves += 1;
        gateway.metrics.moved(why);
        if moves > gateway.config.gateway.max_moves {
            gateway.metrics.request("failed");
            return Err(ApiError::unavailable(format!(
                "the request failed on {moves} nodes (gateway.max_moves)"
            )));
        }
        tracing::warn!(node = %upstream.lease.node, why, "asking another node for a whole response");
        avoid.push(upstream.lease.node.clone());
        upstream = match open(&gateway, &asked, &[], &mut avoid).await? {
            Ok(next) => next,
            Err(refusal) => return Ok(refusal.into_response()),
        };
    }
}

/// A node's whole body, or why it did not come.
async fn read_whole(gateway: &Gateway, upstream: &mut Upstream) -> Result<Vec<u8>, &'static str> {
    let stall = Duration::from_secs(gateway.config.gateway.stall_seconds);
    let mut body = Vec::new();
    let mut heard = Instant::now();
    loop {
        match tokio::time::timeout(TICK, upstream.response.chunk()).await {
            Err(_) if heard.elapsed() > stall => return Err("stalled"),
            Err(_) if !gateway.nodes.is_up(&upstream.lease.node) => return Err("down"),
            Err(_) => {}
            Ok(Err(_)) => return Err("cut"),
            Ok(Ok(None)) => return Ok(body),
            Ok(Ok(Some(bytes))) => {
                heard = Instant::now();
                body.extend_from_slice(&bytes);
            }
        }
    }
}
