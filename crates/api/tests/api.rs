//! The OpenAI-compatible API against a fake binary backend (a thread speaking the generate
//! stream format) and a byte-level fake tokenizer, over real loopback HTTP.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bgs_api::{ApiConfig, ChatMessage, TextCodec};
use bgs_protocol::{HEADER_LEN, RequestHeader, Status, encode_reply};
use serde_json::Value;

/// One byte per token.
struct Bytes;

impl TextCodec for Bytes {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        Ok(text.bytes().map(u32::from).collect())
    }
    fn encode_chat(&self, text: &str) -> Result<Vec<u32>, String> {
        self.encode(text)
    }
    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        let b: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
        Ok(String::from_utf8_lossy(&b).into_owned())
    }
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, String> {
        let mut s = String::new();
        for m in messages {
            s.push_str(&format!("{}:{};", m.role, m.content));
        }
        Ok(s)
    }
}

/// The fake model: answers the prompt's bytes reversed, then EOS (unless ignore-EOS, then
/// `x` forever), up to max tokens. A prompt starting with `BUSY` is refused with busy.
fn fake_backend(cancels: Arc<AtomicUsize>) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let cancels = cancels.clone();
            std::thread::spawn(move || {
                let mut head = [0u8; HEADER_LEN];
                if s.read_exact(&mut head).is_err() {
                    return;
                }
                let h = RequestHeader::decode(&head);
                let mut body = vec![0u8; h.words as usize * 4];
                s.read_exact(&mut body).unwrap();
                let prompt: Vec<u32> = body
                    .chunks(4)
                    .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                let mut out = Vec::new();
                if prompt.starts_with(&[66, 85, 83, 89]) {
                    encode_reply(&mut out, Status::Busy, h.request_id, 0, &[]);
                    let _ = s.write_all(&out);
                    return;
                }
                let mut tokens: Vec<u32> = prompt.iter().rev().copied().collect();
                let ignore_eos = h.flags & 1 != 0;
                let mut n = 0u32;
                let mut eos = false;
                while n < h.param {
                    let t = if (n as usize) < tokens.len() {
                        tokens[n as usize]
                    } else if ignore_eos {
                        u32::from(b'x')
                    } else {
                        eos = true;
                        break;
                    };
                    out.clear();
                    encode_reply(&mut out, Status::Token, h.request_id, n, &[t]);
                    if s.write_all(&out).is_err() {
                        cancels.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    n += 1;
                    // Slow enough that a client that stops early is noticed mid-stream.
                    std::thread::sleep(Duration::from_millis(2));
                }
                tokens.clear();
                out.clear();
                encode_reply(
                    &mut out,
                    Status::EndOfStream,
                    h.request_id,
                    n,
                    &[u32::from(!eos), n],
                );
                let _ = s.write_all(&out);
                // Wait for the client to close (a stop sequence closes early).
                let mut b = [0u8; 1];
                let _ = s.read(&mut b);
            });
        }
    });
    addr
}

fn start() -> (bgs_api::ApiHandle, Arc<AtomicUsize>) {
    let cancels = Arc::new(AtomicUsize::new(0));
    let backend = fake_backend(cancels.clone());
    let cfg = ApiConfig {
        model: "fake".into(),
        backend,
        max_prompt_tokens: 64,
        default_completion_tokens: 16,
        default_chat_tokens: 64,
    };
    let api = bgs_api::spawn("127.0.0.1:0".parse().unwrap(), cfg, Arc::new(Bytes), 1).unwrap();
    (api, cancels)
}

/// A blocking HTTP/1.1 exchange with `Connection: close`; returns status and de-chunked body.
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
    let status: u16 = head[9..12].parse().unwrap();
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = rest;
        loop {
            let (len, after) = rest.split_once("\r\n").unwrap();
            let len = usize::from_str_radix(len.trim(), 16).unwrap();
            if len == 0 {
                break;
            }
            out.push_str(&after[..len]);
            rest = &after[len + 2..];
        }
        out
    } else {
        rest.to_string()
    };
    (status, body)
}

fn json(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

/// The `data:` payloads of a server-sent event stream.
fn sse(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(str::to_string)
        .collect()
}

#[test]
fn models_lists_the_served_model() {
    let (api, _) = start();
    let (code, body) = http(api.addr(), "GET", "/v1/models", "");
    assert_eq!(code, 200);
    let v = json(&body);
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "fake");
}

#[test]
fn completion_stops_at_eos_length_and_stop_sequences() {
    let (api, cancels) = start();
    let (code, body) = http(
        api.addr(),
        "POST",
        "/v1/completions",
        r#"{"model":"fake","prompt":"abc","max_tokens":10}"#,
    );
    assert_eq!(code, 200, "{body}");
    let v = json(&body);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "cba");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["usage"]["total_tokens"], 6);

    let (_, body) = http(
        api.addr(),
        "POST",
        "/v1/completions",
        r#"{"prompt":"abc","max_tokens":2}"#,
    );
    let v = json(&body);
    assert_eq!(v["choices"][0]["text"], "cb");
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    let (_, body) = http(
        api.addr(),
        "POST",
        "/v1/completions",
        r#"{"prompt":"abc","max_tokens":6,"ignore_eos":true}"#,
    );
    assert_eq!(json(&body)["choices"][0]["text"], "cbaxxx");

    // "hello world" reversed is "dlrow olleh": the stop sequence "ow" cuts it after "dlr",
    // and the rest of the stream is cancelled by closing the backend connection.
    let before = cancels.load(Ordering::Relaxed);
    let (_, body) = http(
        api.addr(),
        "POST",
        "/v1/completions",
        r#"{"prompt":"hello world","max_tokens":50,"stop":["ow","zz"]}"#,
    );
    let v = json(&body);
    assert_eq!(v["choices"][0]["text"], "dlr");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while cancels.load(Ordering::Relaxed) == before && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        cancels.load(Ordering::Relaxed) > before,
        "the backend stream was not cut after the stop sequence"
    );
}

#[test]
fn streaming_equals_non_streaming_and_reports_usage() {
    let (api, _) = start();
    let (code, body) = http(
        api.addr(),
        "POST",
        "/v1/completions",
        r#"{"prompt":"streaming!","max_tokens":20,"stream":true,
            "stream_options":{"include_usage":true}}"#,
    );
    assert_eq!(code, 200);
    let events = sse(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    let mut text = String::new();
    let mut reasons = Vec::new();
    let mut usage = None;
    for e in &events[..events.len() - 1] {
        let v = json(e);
        if let Some(c) = v["choices"].as_array().and_then(|c| c.first()) {
            text.push_str(c["text"].as_str().unwrap());
            if !c["finish_reason"].is_null() {
                reasons.push(c["finish_reason"].as_str().unwrap().to_string());
            }
        } else {
            usage = Some(v["usage"].clone());
        }
    }
    assert_eq!(text, "!gnimaerts");
    assert_eq!(reasons, vec!["stop"]);
    let usage = usage.expect("usage chunk");
    assert_eq!(usage["prompt_tokens"], 10);
    assert_eq!(usage["completion_tokens"], 10);
}

#[test]
fn chat_applies_the_template_and_streams_deltas() {
    let (api, _) = start();
    let req = r#"{"model":"fake","messages":[{"role":"system","content":"S"},
        {"role":"user","content":[{"type":"text","text":"hi"}]}],"max_tokens":100}"#;
    let (code, body) = http(api.addr(), "POST", "/v1/chat/completions", req);
    assert_eq!(code, 200, "{body}");
    let v = json(&body);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], ";ih:resu;S:metsys");

    let req = req.replace("\"max_tokens\":100", "\"max_tokens\":100,\"stream\":true");
    let (code, body) = http(api.addr(), "POST", "/v1/chat/completions", &req);
    assert_eq!(code, 200);
    let events = sse(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let first = json(&events[0]);
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let text: String = events[..events.len() - 1]
        .iter()
        .map(|e| {
            json(e)["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    assert_eq!(text, ";ih:resu;S:metsys");
}

#[test]
fn errors_are_openai_shaped() {
    let (api, _) = start();
    let cases: [(&str, &str, u16, &str); 8] = [
        ("/v1/completions", "{not json", 400, "invalid_request_error"),
        (
            "/v1/completions",
            r#"{"prompt":"a","max_tokens":0}"#,
            400,
            "invalid_request_error",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"a","max_tokens":"x"}"#,
            400,
            "invalid_request_error",
        ),
        (
            "/v1/completions",
            r#"{"max_tokens":3}"#,
            400,
            "invalid_request_error",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"a","n":2}"#,
            400,
            "invalid_request_error",
        ),
        (
            "/v1/completions",
            r#"{"model":"other","prompt":"a"}"#,
            404,
            "invalid_request_error",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"BUSY now"}"#,
            503,
            "server_error",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[]}"#,
            400,
            "invalid_request_error",
        ),
    ];
    for (path, body, want, kind) in cases {
        let (code, resp) = http(api.addr(), "POST", path, body);
        assert_eq!(code, want, "{body} -> {resp}");
        let v = json(&resp);
        assert_eq!(v["error"]["type"], kind, "{resp}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    // Too long a prompt names both numbers.
    let long = format!(r#"{{"prompt":"{}"}}"#, "a".repeat(65));
    let (code, resp) = http(api.addr(), "POST", "/v1/completions", &long);
    assert_eq!(code, 400);
    assert!(resp.contains("65 tokens") && resp.contains("64"), "{resp}");
    // Busy while streaming is still an HTTP status, before any event.
    let (code, _) = http(
        api.addr(),
        "POST",
        "/v1/completions",
        r#"{"prompt":"BUSY","stream":true}"#,
    );
    assert_eq!(code, 503);
    let (code, resp) = http(api.addr(), "GET", "/v2/nothing", "");
    assert_eq!(code, 404);
    assert_eq!(json(&resp)["error"]["type"], "not_found_error");
}
