//! Request parsing, validation, generation driving and OpenAI-shaped responses.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State as AxState;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bgs_protocol::Status;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::backend::{BackendError, Event, Generation};
use crate::detok::Detokenizer;
use crate::{ApiConfig, MAX_TOKENS, TextCodec};

/// Shared state of the handlers.
pub(crate) struct State {
    cfg: ApiConfig,
    codec: Arc<dyn TextCodec>,
    next_id: AtomicU64,
    created: u64,
}

impl State {
    pub(crate) fn new(cfg: ApiConfig, codec: Arc<dyn TextCodec>) -> State {
        State {
            cfg,
            codec,
            next_id: AtomicU64::new(1),
            created: unix_now(),
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(crate) fn router(state: Arc<State>) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(|| async {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found_error",
                "no such endpoint; this server has /v1/models, /v1/completions and /v1/chat/completions",
            )
        })
        .with_state(state)
}

/// An OpenAI-style error response.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
        }
    }

    fn bad(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param),
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    fn from_backend(e: &BackendError) -> ApiError {
        match e {
            BackendError::Status(Status::Busy) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "the server is at capacity; retry later",
            ),
            BackendError::Status(s @ (Status::BadParam | Status::UnknownOp)) => ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("the model refused the request ({s:?})"),
            ),
            BackendError::Io(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                format!("generation unavailable: {e}"),
            ),
            _ => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                format!("generation failed: {e}"),
            ),
        }
    }

    fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": Value::Null,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

async fn models(AxState(st): AxState<Arc<State>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": st.cfg.model,
            "object": "model",
            "created": st.created,
            "owned_by": "bgs",
        }],
    }))
    .into_response()
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T: Clone> OneOrMany<T> {
    fn to_vec(&self) -> Vec<T> {
        match self {
            OneOrMany::One(t) => vec![t.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

/// A prompt: text, or token ids (OpenAI accepts both, one or a list).
#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// Fields shared by both endpoints. Unknown fields (sampling parameters, `user`, ...) are
/// accepted and ignored: decoding is greedy.
#[derive(Deserialize)]
struct Common {
    model: Option<String>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    stop: Option<OneOrMany<String>>,
    ignore_eos: Option<bool>,
    n: Option<u32>,
    echo: Option<bool>,
    logprobs: Option<Value>,
}

#[derive(Deserialize)]
struct CompletionRequest {
    prompt: Option<Prompt>,
    #[serde(flatten)]
    common: Common,
}

/// One chat message (`content` as a string or as a list of text parts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
}

#[derive(Deserialize)]
struct RawMessage {
    role: String,
    content: Option<Content>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Deserialize)]
struct ChatRequest {
    messages: Vec<RawMessage>,
    #[serde(flatten)]
    common: Common,
}

/// A validated generation job.
struct Job {
    prompt: Vec<u32>,
    max_tokens: u32,
    ignore_eos: bool,
    stops: Vec<String>,
    stream: bool,
    include_usage: bool,
}

fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!("request body is not valid JSON for this endpoint: {e}"),
        )
    })
}

fn check_common(st: &State, c: &Common, default_tokens: u32) -> Result<Job, ApiError> {
    if let Some(m) = &c.model
        && m != &st.cfg.model
    {
        return Err(ApiError {
            param: Some("model"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!(
                    "the model `{m}` does not exist; this server serves `{}`",
                    st.cfg.model
                ),
            )
        });
    }
    if c.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("n", "n must be 1 (decoding is greedy)"));
    }
    if c.echo == Some(true) {
        return Err(ApiError::bad("echo", "echo is not supported"));
    }
    if c.logprobs
        .as_ref()
        .is_some_and(|v| !v.is_null() && v != &json!(false))
    {
        return Err(ApiError::bad("logprobs", "logprobs are not supported"));
    }
    let max_tokens = c
        .max_completion_tokens
        .or(c.max_tokens)
        .unwrap_or(default_tokens);
    if !(1..=MAX_TOKENS).contains(&max_tokens) {
        return Err(ApiError::bad(
            "max_tokens",
            format!("max_tokens must be between 1 and {MAX_TOKENS}, got {max_tokens}"),
        ));
    }
    let stops = c
        .stop
        .as_ref()
        .map(OneOrMany::to_vec)
        .unwrap_or_default()
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>();
    if stops.len() > 4 {
        return Err(ApiError::bad("stop", "at most 4 stop sequences"));
    }
    let stream = c.stream.unwrap_or(false);
    Ok(Job {
        prompt: Vec::new(),
        max_tokens,
        ignore_eos: c.ignore_eos.unwrap_or(false),
        stops,
        stream,
        include_usage: stream
            && c.stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
    })
}

fn check_prompt(st: &State, ids: Vec<u32>) -> Result<Vec<u32>, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::bad("prompt", "the prompt is empty"));
    }
    if ids.len() > st.cfg.max_prompt_tokens {
        return Err(ApiError::bad(
            "prompt",
            format!(
                "the prompt has {} tokens; this server accepts at most {}",
                ids.len(),
                st.cfg.max_prompt_tokens
            ),
        ));
    }
    Ok(ids)
}

async fn completions(AxState(st): AxState<Arc<State>>, body: Bytes) -> Response {
    let r: Result<Response, ApiError> = async {
        let req: CompletionRequest = parse(&body)?;
        let mut job = check_common(&st, &req.common, st.cfg.default_completion_tokens)?;
        let ids = match req.prompt {
            None => return Err(ApiError::bad("prompt", "prompt is required")),
            Some(Prompt::Text(t)) => st
                .codec
                .encode(&t)
                .map_err(|e| ApiError::bad("prompt", e))?,
            Some(Prompt::Ids(ids)) => ids,
            Some(Prompt::Texts(mut v)) if v.len() == 1 => st
                .codec
                .encode(&v.remove(0))
                .map_err(|e| ApiError::bad("prompt", e))?,
            Some(Prompt::IdLists(mut v)) if v.len() == 1 => v.remove(0),
            Some(_) => {
                return Err(ApiError::bad(
                    "prompt",
                    "only one prompt per request is supported",
                ));
            }
        };
        job.prompt = check_prompt(&st, ids)?;
        run(st.clone(), job, Kind::Completion).await
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(AxState(st): AxState<Arc<State>>, body: Bytes) -> Response {
    let r: Result<Response, ApiError> = async {
        let req: ChatRequest = parse(&body)?;
        let mut job = check_common(&st, &req.common, st.cfg.default_chat_tokens)?;
        if req.messages.is_empty() {
            return Err(ApiError::bad("messages", "messages must not be empty"));
        }
        let mut messages = Vec::with_capacity(req.messages.len());
        for m in req.messages {
            if !matches!(
                m.role.as_str(),
                "system" | "user" | "assistant" | "tool" | "developer"
            ) {
                return Err(ApiError::bad(
                    "messages",
                    format!("unknown message role `{}`", m.role),
                ));
            }
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(t)) => t,
                Some(Content::Parts(parts)) => {
                    let mut s = String::new();
                    for p in parts {
                        if p.kind != "text" {
                            return Err(ApiError::bad(
                                "messages",
                                format!("content parts of type `{}` are not supported", p.kind),
                            ));
                        }
                        s.push_str(p.text.as_deref().unwrap_or(""));
                    }
                    s
                }
            };
            // "developer" is the newer name of "system" in OpenAI's API.
            let role = if m.role == "developer" {
                "system".to_string()
            } else {
                m.role
            };
            messages.push(ChatMessage { role, content });
        }
        let text = st
            .codec
            .render_chat(&messages)
            .map_err(|e| ApiError::bad("messages", format!("chat template: {e}")))?;
        let ids = st
            .codec
            .encode_chat(&text)
            .map_err(|e| ApiError::bad("messages", e))?;
        job.prompt = check_prompt(&st, ids)?;
        run(st.clone(), job, Kind::Chat).await
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// Text produced so far, with stop-sequence handling: `take` returns what may be sent now,
/// holding back a tail that could still become a stop sequence.
struct StopText {
    stops: Vec<String>,
    text: String,
    sent: usize,
    stopped: bool,
}

impl StopText {
    fn new(stops: Vec<String>) -> StopText {
        StopText {
            stops,
            text: String::new(),
            sent: 0,
            stopped: false,
        }
    }

    /// Add a piece; returns the text that can be released now.
    fn push(&mut self, piece: &str) -> String {
        self.text.push_str(piece);
        // A stop sequence may start in the held-back tail: search from the earliest byte
        // not yet sent.
        let mut cut: Option<usize> = None;
        for s in &self.stops {
            if let Some(i) = self.text[self.sent..].find(s.as_str()) {
                let at = self.sent + i;
                cut = Some(cut.map_or(at, |c| c.min(at)));
            }
        }
        if let Some(at) = cut {
            self.text.truncate(at);
            self.stopped = true;
            return self.release(at);
        }
        // Hold back the longest suffix that is a proper prefix of some stop sequence.
        let mut hold = 0;
        for s in &self.stops {
            for (k, _) in s.char_indices().skip(1) {
                if self.text.ends_with(&s[..k]) {
                    hold = hold.max(k);
                }
            }
        }
        let upto = self.text.len() - hold;
        self.release(upto.max(self.sent))
    }

    fn release(&mut self, upto: usize) -> String {
        let out = self.text[self.sent..upto].to_string();
        self.sent = upto;
        out
    }

    /// End of stream: everything held back goes out.
    fn flush(&mut self) -> String {
        let n = self.text.len();
        self.release(n)
    }
}

/// The outcome of a finished generation.
struct Finished {
    text: String,
    completion_tokens: usize,
    reason: &'static str,
}

/// Drives one generation: tokens to text pieces, stop sequences, finish reason.
struct Driver {
    codec: Arc<dyn TextCodec>,
    generation: Generation,
    detok: Detokenizer,
    stop: StopText,
    tokens: usize,
    finished: Option<&'static str>,
}

impl Driver {
    async fn start(st: &State, job: &Job) -> Result<Driver, BackendError> {
        let generation =
            Generation::start(st.cfg.backend, &job.prompt, job.max_tokens, job.ignore_eos).await?;
        Ok(Driver {
            codec: st.codec.clone(),
            generation,
            detok: Detokenizer::default(),
            stop: StopText::new(job.stops.clone()),
            tokens: 0,
            finished: None,
        })
    }

    /// The next piece of text (possibly empty) or `None` when finished.
    async fn next(&mut self) -> Result<Option<String>, BackendError> {
        if self.finished.is_some() {
            return Ok(None);
        }
        let decode_err = |e: String| BackendError::Protocol(format!("detokenize: {e}"));
        match self.generation.next().await? {
            Some(Event::Token(id)) => {
                self.tokens += 1;
                let piece = self
                    .detok
                    .push(self.codec.as_ref(), id)
                    .map_err(decode_err)?
                    .unwrap_or_default();
                let out = self.stop.push(&piece);
                if self.stop.stopped {
                    // Dropping the generation (with the driver) closes its connection, which
                    // cancels the rest of the stream on the server.
                    self.finished = Some("stop");
                }
                Ok(Some(out))
            }
            Some(Event::End { eos }) => {
                let tail = self
                    .detok
                    .finish(self.codec.as_ref())
                    .map_err(decode_err)?
                    .unwrap_or_default();
                let mut out = self.stop.push(&tail);
                if !self.stop.stopped {
                    out.push_str(&self.stop.flush());
                }
                self.finished = Some(if eos || self.stop.stopped {
                    "stop"
                } else {
                    "length"
                });
                Ok(Some(out))
            }
            None => Ok(None),
        }
    }
}

async fn run(st: Arc<State>, job: Job, kind: Kind) -> Result<Response, ApiError> {
    let mut driver = Driver::start(&st, &job)
        .await
        .map_err(|e| ApiError::from_backend(&e))?;
    let id = format!(
        "{}-{}",
        if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        st.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let created = unix_now();
    let model = st.cfg.model.clone();
    let prompt_tokens = job.prompt.len();
    if !job.stream {
        let mut text = String::new();
        while let Some(piece) = driver
            .next()
            .await
            .map_err(|e| ApiError::from_backend(&e))?
        {
            text.push_str(&piece);
        }
        let done = Finished {
            text,
            completion_tokens: driver.tokens,
            reason: driver.finished.unwrap_or("length"),
        };
        let usage = usage(prompt_tokens, done.completion_tokens);
        let body = match kind {
            Kind::Completion => json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": done.text, "logprobs": null,
                             "finish_reason": done.reason}],
                "usage": usage,
            }),
            Kind::Chat => json!({
                "id": id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0,
                             "message": {"role": "assistant", "content": done.text},
                             "logprobs": null, "finish_reason": done.reason}],
                "usage": usage,
            }),
        };
        return Ok(axum::Json(body).into_response());
    }
    // Streaming: an error before the first token is still an HTTP error status (busy → 503);
    // later errors end the event stream with an error event.
    let first = driver
        .next()
        .await
        .map_err(|e| ApiError::from_backend(&e))?;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<SseEvent>(16);
    let usage_id = id.clone();
    let chunk = move |text: Option<&str>, reason: Option<&str>, first: bool| -> SseEvent {
        let body = match kind {
            Kind::Completion => json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text.unwrap_or(""), "logprobs": null,
                             "finish_reason": reason}],
            }),
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({
                    "id": id, "object": "chat.completion.chunk", "created": created,
                    "model": model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null,
                                 "finish_reason": reason}],
                })
            }
        };
        SseEvent::default().data(body.to_string())
    };
    let include_usage = job.include_usage;
    tokio::spawn(async move {
        let mut piece = first;
        let mut first_chunk = true;
        while let Some(text) = piece {
            if (!text.is_empty() || first_chunk)
                && tx
                    .send(chunk(Some(&text), None, first_chunk))
                    .await
                    .is_err()
            {
                return; // the client went away: dropping the driver cancels
            }
            first_chunk = false;
            piece = tokio::select! {
                r = driver.next() => match r {
                    Ok(p) => p,
                    Err(e) => {
                        let err = ApiError::from_backend(&e);
                        let _ = tx.send(SseEvent::default().data(err.body().to_string())).await;
                        return;
                    }
                },
                () = tx.closed() => return,
            };
        }
        let reason = driver.finished.unwrap_or("length");
        if tx.send(chunk(None, Some(reason), false)).await.is_err() {
            return;
        }
        if include_usage {
            let u = json!({
                "id": usage_id, "object": match kind {
                    Kind::Completion => "text_completion",
                    Kind::Chat => "chat.completion.chunk",
                },
                "choices": [], "usage": usage(prompt_tokens, driver.tokens),
            });
            let _ = tx.send(SseEvent::default().data(u.to_string())).await;
        }
        let _ = tx.send(SseEvent::default().data("[DONE]")).await;
    });
    let stream = futures_util::stream::poll_fn(move |cx| {
        rx.poll_recv(cx).map(|o| o.map(Ok::<_, Infallible>))
    });
    Ok(Sse::new(stream).into_response())
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

#[cfg(test)]
mod tests {
    use super::StopText;

    #[test]
    fn stop_text_holds_back_possible_prefixes_and_cuts_at_the_stop() {
        let mut s = StopText::new(vec!["END".into()]);
        assert_eq!(s.push("hello E"), "hello ");
        assert!(!s.stopped);
        assert_eq!(s.push("N"), "");
        assert_eq!(s.push("D and more"), "");
        assert!(s.stopped);
        assert_eq!(s.text, "hello ");

        let mut s = StopText::new(vec!["\n\n".into(), "xyz".into()]);
        assert_eq!(s.push("a\n"), "a");
        assert_eq!(s.push("b"), "\nb");
        assert_eq!(s.flush(), "");
        assert!(!s.stopped);
    }

    #[test]
    fn stop_text_without_stops_releases_everything() {
        let mut s = StopText::new(vec![]);
        assert_eq!(s.push("abc"), "abc");
        assert_eq!(s.push(""), "");
        assert_eq!(s.flush(), "");
    }
}
