//! `run_openai` against a tiny in-test OpenAI-compatible server (chunked server-sent events,
//! keep-alive), streaming and not.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use bgs_load::{GenerateConfig, LoadConfig, OpenAiConfig, run_openai};
use bgs_protocol::Op;

fn chunk(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(format!("{:x}\r\n{s}\r\n", s.len()).as_bytes());
}

fn serve(s: TcpStream, busy_every: u32) {
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut w = s;
    let mut n = 0u32;
    loop {
        let mut len = 0usize;
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        loop {
            line.clear();
            r.read_line(&mut line).unwrap();
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some(v) = l.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0u8; len];
        r.read_exact(&mut body).unwrap();
        let req: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(req["model"], "m");
        assert_eq!(req["max_tokens"], 3);
        n += 1;
        if busy_every > 0 && n.is_multiple_of(busy_every) {
            let b = r#"{"error":{"message":"busy"}}"#;
            write!(
                w,
                "HTTP/1.1 503 Service Unavailable\r\nContent-Length: {}\r\n\r\n{b}",
                b.len()
            )
            .unwrap();
            continue;
        }
        if req["stream"] == true {
            let mut out = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
            for t in ["a", "b", "c"] {
                chunk(
                    &mut out,
                    &format!("data: {{\"choices\":[{{\"text\":\"{t}\"}}]}}\n\n"),
                );
            }
            chunk(
                &mut out,
                "data: {\"choices\":[],\"usage\":{\"completion_tokens\":3}}\n\n",
            );
            chunk(&mut out, "data: [DONE]\n\n");
            out.extend_from_slice(b"0\r\n\r\n");
            w.write_all(&out).unwrap();
        } else {
            let b = r#"{"choices":[{"text":"abc","finish_reason":"length"}],"usage":{"completion_tokens":3}}"#;
            write!(w, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}", b.len()).unwrap();
        }
    }
}

fn server(busy_every: u32) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let s = s.unwrap();
            std::thread::spawn(move || serve(s, busy_every));
        }
    });
    addr
}

fn cfg() -> LoadConfig {
    LoadConfig {
        op: Op::Generate,
        rate: 400.0,
        connections: 4,
        duration: None,
        requests: Some(200),
        warmup: Duration::from_millis(50),
        timeout: Duration::from_secs(5),
        distinct_payloads: 8,
        generate: GenerateConfig {
            max_tokens: 3,
            ..GenerateConfig::default()
        },
        ..LoadConfig::default()
    }
}

#[test]
fn streams_and_plain_responses_are_counted_with_their_tokens() {
    for stream in [true, false] {
        let addr = server(0);
        let oa = OpenAiConfig {
            url: format!("http://{addr}/v1/completions"),
            model: "m".into(),
            stream,
        };
        let r = run_openai(&cfg(), &oa).unwrap();
        println!("{r}");
        assert_eq!(r.counts.ok, 200, "{r}");
        assert_eq!(r.failures + r.warmup_failures, 0, "{r}");
        let g = r.generate.as_ref().unwrap();
        assert_eq!(g.tokens, 600);
        assert!(g.ttft.is_some() && r.latency.is_some());
        if stream {
            // Three text chunks per stream: two gaps each.
            assert_eq!(g.inter_token.unwrap().count, 400);
        }
    }
}

#[test]
fn busy_is_counted_and_bad_urls_are_refused() {
    let addr = server(4);
    let oa = OpenAiConfig {
        url: format!("http://{addr}"),
        model: "m".into(),
        stream: true,
    };
    let r = run_openai(&cfg(), &oa).unwrap();
    assert_eq!(r.counts.ok + r.counts.busy, 200, "{r}");
    assert!(r.counts.busy > 0 && r.failures == 0, "{r}");
    let bad = OpenAiConfig {
        url: "https://example.invalid".into(),
        model: "m".into(),
        stream: true,
    };
    assert!(run_openai(&cfg(), &bad).is_err());
}
