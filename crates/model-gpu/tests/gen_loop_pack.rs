//! `bgs_gl_pack` (the C step loop writing the GPU model's step-input buffer through the
//! generated `include/bgs_llm_step.h`) against the Rust `pack_step`: for the steps the C loop
//! plans over random requests, both must write the same words and report the same buckets.

use bgs_llm::Item;
use bgs_llm::gen_loop::{CGenLoop, GlLimits, step_words};
use bgs_model_gpu::StepGeometry;
use bgs_model_gpu::c_header::c_geometry;
use bgs_model_gpu::host::{bucket_for, pack_step};

/// A small deterministic generator (xorshift), enough to vary the schedules.
struct Rng(u64);

impl Rng {
    fn next(&mut self, below: u32) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % below as u64) as u32
    }
}

fn run(seed: u64) {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let block_size = 1 + rng.next(8);
    let num_blocks = 4 + rng.next(60);
    let max_running = 1 + rng.next(6);
    let max_batched = max_running + rng.next(40);
    let max_positions = 8 + rng.next(120);
    let vocab = 50;
    let limits = GlLimits {
        block_size,
        num_blocks,
        max_seqs: max_running + rng.next(4),
        max_running,
        max_batched_tokens: max_batched,
        max_prompt: 256,
        vocab_size: vocab,
        max_positions,
        max_eos: 1,
        ignore_eos: 0,
    };
    let mut c = CGenLoop::new(limits, &[0]).unwrap();
    let max_tokens = bucket_for(max_batched as usize).unwrap();
    let geo = StepGeometry {
        max_tokens,
        max_samples: bucket_for(max_running as usize).unwrap().min(max_tokens),
        max_seqs: max_running as usize,
        max_blocks_per_seq: (max_positions.div_ceil(block_size)).min(num_blocks) as usize,
        block_size: block_size as usize,
        num_blocks: num_blocks as usize,
    };
    let cgeo = c_geometry(&geo).unwrap();
    assert_eq!(step_words(&cgeo), geo.words(), "generated words() differs");
    let credit = vec![10u32; limits.max_seqs as usize];
    let mut stream = 0;
    for _ in 0..60 {
        if rng.next(3) == 0 {
            let len = 1 + rng.next(30) as usize;
            let prompt: Vec<u32> = (0..len).map(|_| rng.next(vocab)).collect();
            let _ = c.admit(stream, 1, 1 + rng.next(20), rng.next(2), &prompt);
            stream += 1;
        }
        let n = c.plan(&credit).unwrap();
        if n > 0 {
            let planned: Vec<_> = (0..n).map(|k| c.item(k).unwrap()).collect();
            let items: Vec<Item<'_>> = planned
                .iter()
                .map(|it| Item {
                    tokens: c.item_tokens(it),
                    pos: it.pos as usize,
                    blocks: c.item_blocks(it),
                    sample: it.sample != 0,
                })
                .collect();
            let want: Vec<bool> = items.iter().map(|it| it.sample).collect();
            let mut rbuf = vec![7i32; geo.words()];
            let mut cbuf = vec![7i32; geo.words()];
            let r = pack_step(
                &geo,
                &items,
                &want,
                vocab as usize,
                max_positions as usize,
                &mut rbuf,
            )
            .unwrap();
            let p = c.pack(&cgeo, &mut cbuf).unwrap();
            assert_eq!(cbuf, rbuf, "seed {seed}: buffers differ");
            assert_eq!(
                (p.tokens, p.bucket, p.samples, p.sample_bucket, p.words),
                (
                    r.tokens as u32,
                    r.bucket as u32,
                    r.samples as u32,
                    r.sample_bucket as u32,
                    r.words as u32
                ),
                "seed {seed}"
            );
            drop(items);
            let next: Vec<u32> = (0..n).map(|_| rng.next(vocab)).collect();
            c.finish(&next).unwrap();
        }
        let owed = c.owed().to_vec();
        for f in owed {
            c.delivered(f.slot, 1);
        }
        c.check().unwrap();
    }
}

#[test]
fn c_pack_equals_rust_pack_step() {
    for seed in 0..400 {
        run(seed);
    }
}

#[test]
fn a_step_larger_than_the_geometry_is_refused() {
    let limits = GlLimits {
        block_size: 4,
        num_blocks: 16,
        max_seqs: 2,
        max_running: 2,
        max_batched_tokens: 16,
        max_prompt: 256,
        vocab_size: 50,
        max_positions: 64,
        max_eos: 0,
        ignore_eos: 0,
    };
    let mut c = CGenLoop::new(limits, &[]).unwrap();
    c.admit(0, 1, 4, 0, &[1; 12]).unwrap();
    assert_eq!(c.plan(&[2, 2]).unwrap(), 1);
    let small = StepGeometry {
        max_tokens: 8,
        max_samples: 1,
        max_seqs: 1,
        max_blocks_per_seq: 16,
        block_size: 4,
        num_blocks: 16,
    };
    let mut buf = vec![0i32; small.words()];
    let e = c.pack(&c_geometry(&small).unwrap(), &mut buf).unwrap_err();
    assert!(e.contains("does not fit"), "{e}");
    let e = c
        .pack(&c_geometry(&small).unwrap(), &mut buf[..3])
        .unwrap_err();
    assert!(e.contains("words"), "{e}");
}
