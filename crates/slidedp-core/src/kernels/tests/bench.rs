//! Throughput of AdamW and the cast, in GB/s of memory touched. Ignored by default; run with
//! `cargo test --release -p slidedp-core kernels::tests::bench -- --ignored --nocapture`
//! (`SLIDEDP_BENCH_ELEMS` sets the array length, `SLIDEDP_BENCH_THREADS` the comma-separated
//! thread counts; defaults 64 Mi elements and 1,2).

use std::time::Instant;

use super::*;

/// Best wall time of 3 runs after one warm-up, in seconds.
fn best_secs(mut run: impl FnMut()) -> f64 {
    run();
    (0..3)
        .map(|_| {
            let start = Instant::now();
            run();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
#[ignore = "throughput run; use --release --ignored --nocapture"]
fn bench() {
    let n: usize = env_or("SLIDEDP_BENCH_ELEMS", 64 << 20);
    let threads: Vec<usize> = std::env::var("SLIDEDP_BENCH_THREADS")
        .unwrap_or_else(|_| "1,2".into())
        .split(',')
        .filter_map(|t| t.trim().parse().ok())
        .collect();
    let mut rng = Rng::new(10);
    let (mut p, mut m, mut v) = (vec![0.5f32; n], vec![0.0f32; n], vec![0.0f32; n]);
    let g: Vec<f32> = (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let g16 = to_bf16(&g);
    let mut out = vec![0u16; n];
    let gb = |bytes_per_elem: usize, secs: f64| (n * bytes_per_elem) as f64 / secs / 1e9;
    for isa in Isa::all_supported() {
        for &t in &threads {
            let k = Kernels::new(t, isa).unwrap();
            let mut step = 0;
            let mut adamw = |grad: GradSlice<'_>, out: Option<&mut [u16]>| {
                step += 1;
                k.adamw(&hp(step), &mut p, &mut m, &mut v, grad, out)
                    .unwrap();
            };
            // Bytes touched per element: p, m, v read and written, the gradient read, bf16 written.
            let f32_grad = best_secs(|| adamw(GradSlice::F32(&g), None));
            let bf16_grad_out = best_secs(|| adamw(GradSlice::Bf16(&g16), Some(&mut out)));
            let cast = best_secs(|| k.cast_f32_to_bf16(&g, &mut out).unwrap());
            eprintln!(
                "{n} elems, {:>6} x{t}: adamw f32 grad {:6.1} GB/s ({:.1} ms) | adamw bf16 grad + bf16 out {:6.1} GB/s | cast {:6.1} GB/s",
                isa.name(),
                gb(28, f32_grad),
                f32_grad * 1e3,
                gb(28, bf16_grad_out),
                gb(6, cast),
            );
        }
    }
}
