use brook_core::config::QuantSpec;
use brook_core::linear::{tile_bytes, untile_bytes};
fn main() {
    let (out, n) = (512usize, 2048usize);
    let spec = QuantSpec {
        bits: 4,
        group_size: 64,
    };
    let f = brook_core::dtype::DType::BF16;
    let mut p: Vec<u8> = (0..out * n / 2).map(|i| (i * 7 + 3) as u8).collect();
    let g = n / 64;
    let mut s = vec![1u8; out * g * 2];
    let mut b = vec![2u8; out * g * 2];
    assert!(tile_bytes(spec, f, out, n, &mut p, &mut s, &mut b));
    let (mut dp, mut ds, mut db) = (vec![0u8; p.len()], vec![0u8; s.len()], vec![0u8; b.len()]);
    let t = std::time::Instant::now();
    let reps = 60;
    for _ in 0..reps {
        untile_bytes(spec, f, out, n, [&p, &s, &b], [&mut dp, &mut ds, &mut db]);
    }
    let e = t.elapsed().as_secs_f64() / reps as f64;
    println!(
        "untile 512x2048 q4g64: {:.3} ms, {:.2} GB/s",
        e * 1e3,
        (p.len() + s.len() * 2) as f64 / e / 1e9
    );
}
