//! A stream of several choices (`n` > 1) through the gateway: split into one stream per
//! choice, each relayed and moved on its own as a stream of one choice is ([`relay`]), and
//! merged back into the one stream the client asked for. A node samples choice `i` of a
//! request with seed `seed + i`; choice `i` is asked with `n = 1` and that seed, so it draws
//! what it would have drawn among the others, on whichever node it ends on.
//!
//! The merged stream carries each choice's chunks under its `index`, the first chunk's
//! `id` and `created` throughout, and, when usage was asked for, one usage chunk at the
//! end: the prompt counted once, the choices' completion tokens summed (as a node counts
//! `n` choices).

use actix_web::web::{self, Bytes};
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::Gateway;
use super::relay::{self, Asked, Refusal};
use crate::api::ApiError;
use reqwest::header::HeaderValue;

/// Streams of more choices go to one node whole, and cannot move: each choice split off is
/// a stream and a place in some node's batch.
pub const MAX_SPLIT: u64 = 16;

/// Opens every choice's stream (a refusal of any is the request's answer, the streams
/// already open closed), then relays them merged.
pub async fn forward(
    gateway: web::Data<Gateway>,
    asked: Asked,
) -> Result<Result<(mpsc::Receiver<Bytes>, Option<HeaderValue>), Refusal>, ApiError> {
    let parts = asked.split();
    let mut opened = Vec::with_capacity(parts.len());
    for part in &parts {
        let mut avoid = Vec::new();
        match relay::open(&gateway, part, &[], &mut avoid).await? {
            Ok(upstream) => opened.push((upstream, avoid)),
            Err(refusal) => return Ok(Err(refusal)),
        }
    }
    // Degraded if any choice's node says so.
    let degraded = opened.iter().find_map(|(upstream, _)| upstream.degraded());
    let (sender, receiver) = mpsc::channel::<Bytes>(64);
    let mut streams = Vec::with_capacity(parts.len());
    for (part, (upstream, avoid)) in parts.into_iter().zip(opened) {
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        actix_web::rt::spawn(relay::relay_events(
            gateway.clone(),
            part,
            upstream,
            avoid,
            tx,
        ));
        streams.push(rx);
    }
    actix_web::rt::spawn(merge(streams, sender));
    Ok(Ok((receiver, degraded)))
}

/// What the merged stream has seen.
#[derive(Default)]
struct Merged {
    /// The first chunk's `id` and `created`.
    id: Option<(Value, Value)>,
    /// Choices whose stream has ended.
    done: usize,
    /// The first usage chunk, and the completion tokens of every choice's.
    usage: Option<Value>,
    completion_tokens: u64,
}

/// Relays the events of every choice's stream (`streams[i]` is choice `i`) as one stream.
async fn merge(streams: Vec<mpsc::Receiver<Bytes>>, sender: mpsc::Sender<Bytes>) {
    let choices = streams.len();
    let mut events =
        futures::stream::select_all(streams.into_iter().enumerate().map(|(index, receiver)| {
            futures::stream::unfold(receiver, move |mut receiver| async move {
                let bytes = receiver.recv().await?;
                Some(((index, bytes), receiver))
            })
            .boxed()
        }));
    let mut merged = Merged::default();
    while let Some((index, bytes)) = events.next().await {
        let text = String::from_utf8_lossy(&bytes);
        for data in text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")) {
            let out = match merged.event(index, data) {
                Event::Pass(chunk) => chunk,
                Event::Keep => continue,
                Event::End(last) => {
                    for chunk in last {
                        let _ = sender.send(sse(&chunk)).await;
                    }
                    let _ = sender.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
                    return;
                }
            };
            if sender.send(sse(&out)).await.is_err() {
                // The client went away: dropping the streams stops their relays.
                return;
            }
        }
        if merged.done == choices {
            let last = merged.usage_chunk();
            for chunk in last {
                let _ = sender.send(sse(&chunk)).await;
            }
            let _ = sender.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
            return;
        }
    }
    // Every relay ended without a word (it could not have: each ends with `[DONE]`).
    let error = ApiError::unavailable("a choice's stream ended early").body();
    let _ = sender.send(sse(&error)).await;
    let _ = sender.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
}

/// What to do with one event of a choice's stream.
enum Event {
    Pass(Value),
    Keep,
    /// The merged stream ends after these chunks.
    End(Vec<Value>),
}

impl Merged {
    fn event(&mut self, index: usize, data: &str) -> Event {
        if data == "[DONE]" {
            self.done += 1;
            return Event::Keep;
        }
        let Ok(mut chunk) = serde_json::from_str::<Value>(data) else {
            return Event::Keep;
        };
        if chunk.get("error").is_some() {
            // A choice that failed on every node it moved to fails the request.
            return Event::End(vec![chunk]);
        }
        let Some(choices) = chunk["choices"].as_array_mut() else {
            return Event::Keep;
        };
        if choices.is_empty() {
            if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
                self.completion_tokens += usage["completion_tokens"].as_u64().unwrap_or(0);
                self.usage.get_or_insert(chunk);
            }
            return Event::Keep;
        }
        for choice in choices.iter_mut() {
            choice["index"] = json!(index);
        }
        self.stamp(&mut chunk);
        Event::Pass(chunk)
    }

    /// Gives `chunk` the merged stream's `id` and `created` (the first chunk's).
    fn stamp(&mut self, chunk: &mut Value) {
        match &self.id {
            None => self.id = Some((chunk["id"].clone(), chunk["created"].clone())),
            Some((id, created)) => {
                chunk["id"] = id.clone();
                chunk["created"] = created.clone();
            }
        }
    }

    /// The one usage chunk of the merged stream, if usage was asked for.
    fn usage_chunk(&mut self) -> Vec<Value> {
        let Some(mut chunk) = self.usage.take() else {
            return Vec::new();
        };
        let prompt_tokens = chunk["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
        chunk["usage"]["completion_tokens"] = json!(self.completion_tokens);
        chunk["usage"]["total_tokens"] = json!(prompt_tokens + self.completion_tokens);
        self.stamp(&mut chunk);
        vec![chunk]
    }
}

fn sse(chunk: &Value) -> Bytes {
    Bytes::from(format!("data: {chunk}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(id: &str, text: &str) -> String {
        json!({"id": id, "created": 7, "choices": [{"index": 0, "text": text}]}).to_string()
    }

    fn usage(id: &str, completion: u64) -> String {
        json!({"id": id, "created": 9, "choices": [],
               "usage": {"prompt_tokens": 4, "completion_tokens": completion,
                         "total_tokens": 4 + completion}})
        .to_string()
    }

    #[test]
    fn choices_keep_their_index_and_the_first_id_and_usage_adds_up() {
        let mut merged = Merged::default();
        let Event::Pass(first) = merged.event(1, &chunk("b", "x")) else {
            panic!()
        };
        assert_eq!(first["choices"][0]["index"], 1);
        let Event::Pass(second) = merged.event(0, &chunk("a", "y")) else {
            panic!()
        };
        assert_eq!(
            (second["id"].as_str(), &second["choices"][0]["index"]),
            (Some("b"), &json!(0))
        );
        assert!(matches!(merged.event(0, &usage("a", 3)), Event::Keep));
        assert!(matches!(merged.event(1, &usage("b", 5)), Event::Keep));
        assert!(matches!(merged.event(0, "[DONE]"), Event::Keep));
        assert!(matches!(merged.event(1, "[DONE]"), Event::Keep));
        assert_eq!(merged.done, 2);
        let last = merged.usage_chunk();
        assert_eq!(
            last[0]["usage"],
            json!({"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12})
        );
        assert_eq!(last[0]["id"], "b");
        let error = ApiError::unavailable("gone").body().to_string();
        assert!(matches!(merged.event(0, &error), Event::End(_)));
    }
}
