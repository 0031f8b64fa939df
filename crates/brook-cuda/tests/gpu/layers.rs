//! The layer kernels on their own: one token through routed and shared experts with the
//! decode launches, and the delta rule's kernels, against the reference's products and
//! recurrence ([`MoeCase`] also serves `batch.rs`).

use super::*;

/// One MoE layer's weights for the kernel tests: 16 random experts of `fmt` ([gate, up,
/// down], h → i → h) in GPU slots of one layout behind a table, as GpuExperts makes them,
/// and a random shared expert (h → is → h) uploaded as dense matrices.
pub(super) struct MoeCase {
    pub(super) experts: Vec<[brook_core::linear::Linear; 3]>,
    pub(super) shared: [brook_core::linear::Linear; 3],
    pub(super) _slots: brook_cuda::gpu::DevBuf,
    /// One device pointer per expert.
    pub(super) tab: brook_cuda::gpu::DevBuf,
    /// Where gate, up and down sit in a slot.
    pub(super) placed: [brook_cuda::weights::Placement; 3],
    pub(super) _shared_bufs: Vec<brook_cuda::gpu::DevBuf>,
    /// The shared expert's gate, up and down.
    pub(super) sm: [Mat; 3],
}

/// One decode call of a [`MoeCase`]: `tokens` tokens of `k` picks; device pointers x
/// [tokens, h], the picks `sel` and their weights `wts` [tokens, k], the shared experts' gates
/// `sg`, `sgs` floats apart.
#[derive(Debug, Clone, Copy)]
pub(super) struct MoeIn {
    pub(super) k: usize,
    pub(super) tokens: usize,
    pub(super) x: u64,
    pub(super) sel: u64,
    pub(super) wts: u64,
    pub(super) sg: u64,
    pub(super) sgs: usize,
}

impl MoeCase {
    pub(super) fn new(
        g: &Arc<Gpu>,
        rng: &mut Rng,
        fmt: Format,
        h: usize,
        i: usize,
        is: usize,
    ) -> Self {
        let e = 16;
        let experts: Vec<[_; 3]> = (0..e)
            .map(|_| {
                [
                    random_linear(rng, i, h, fmt),
                    random_linear(rng, i, h, fmt),
                    random_linear(rng, h, i, fmt),
                ]
            })
            .collect();
        let v0 = experts[0].each_ref().map(|l| l.view());
        let pg = place(&v0[0], 0, "gate").expect("place");
        let pu = place(&v0[1], pg.end, "up").expect("place");
        let pd = place(&v0[2], pu.end, "down").expect("place");
        let slot = pd.end.div_ceil(256) * 256;
        let mut img = vec![0u8; slot * e];
        for (n, ex) in experts.iter().enumerate() {
            let dst = &mut img[n * slot..(n + 1) * slot];
            for (l, p) in ex.iter().zip([&pg, &pu, &pd]) {
                copy_into(&l.view(), p, dst);
            }
        }
        let slots = g.upload(&img, "slots").expect("slots");
        let table: Vec<u64> = (0..e).map(|n| slots.ptr + (n * slot) as u64).collect();
        let tab = g.upload(&table, "table").expect("table");
        let shared = [
            random_linear(rng, is, h, fmt),
            random_linear(rng, is, h, fmt),
            random_linear(rng, h, is, fmt),
        ];
        let (sm, bufs): (Vec<Mat>, Vec<_>) = shared
            .iter()
            .map(|l| upload_linear(g, &l.view(), "shared").expect("upload"))
            .unzip();
        MoeCase {
            experts,
            shared,
            _slots: slots,
            tab,
            placed: [pg, pu, pd],
            _shared_bufs: bufs,
            sm: [sm[0], sm[1], sm[2]],
        }
    }

    /// The hidden size, an expert's intermediate size and the shared expert's.
    fn dims(&self) -> (usize, usize, usize) {
        let [pg, _, pd] = &self.placed;
        (
            pd.mat.rows as usize,
            pg.mat.rows as usize,
            self.sm[0].rows as usize,
        )
    }

    /// The decode form of the MoE (see [`MoeIn`]): SwiGLU in the gate/up launch, the downs
    /// and the weighted sum in the second. Returns the outputs [tokens, h].
    pub(super) fn decode(&self, g: &Arc<Gpu>, m: MoeIn) -> Vec<f32> {
        let (k, tokens) = (m.k, m.tokens);
        let [pg, pu, pd] = &self.placed;
        let (h, i, is) = self.dims();
        let hd = g.zeros(tokens * k * i * 4, "h").expect("h");
        let hsd = g.zeros(tokens * is * 4, "hs").expect("hs");
        let out = g.upload(&vec![f32::NAN; tokens * h], "out").expect("out");
        let tab = self.tab.ptr;
        let shared = [self.sm[0], self.sm[1]];
        ops::qmv_experts(
            g, pg.mat, pu.mat, tab, m.sel, k, k as i32, shared, true, tokens, m.x, hd.ptr, hsd.ptr,
            None,
        )
        .expect("gate/up");
        ops::moe_down(
            g, pd.mat, tab, m.sel, m.wts, k, self.sm[2], m.sg, hd.ptr, hsd.ptr, out.ptr, tokens,
            m.sgs, None,
        )
        .expect("down");
        out.read().expect("read")
    }

    /// [`MoeCase::decode`] with the experts grouped (`grouped::moe`), or `None` where its
    /// kernels don't take these shapes.
    pub(super) fn decode_grouped(&self, g: &Arc<Gpu>, m: MoeIn) -> Option<Vec<f32>> {
        let (k, tokens) = (m.k, m.tokens);
        let [pg, pu, pd] = &self.placed;
        let (mats, shared) = ([pg.mat, pu.mat, pd.mat], self.sm);
        if !brook_cuda::grouped::fits(g, mats, shared, k, tokens) {
            return None;
        }
        let (h, i, is) = self.dims();
        let f = |n: usize, what: &str| g.zeros(n * 4, what).expect(what);
        let (hd, hsd, groups) = (
            f(tokens * k * i, "h"),
            f(tokens * is, "hs"),
            f(4 * tokens * k + 1, "groups"),
        );
        let (ey, so) = (f(tokens * k * h, "ey"), f(tokens * h, "so"));
        let out = g.upload(&vec![f32::NAN; tokens * h], "out").expect("out");
        let w = brook_cuda::grouped::GroupScratch {
            groups: groups.ptr,
            ey: ey.ptr,
            so: so.ptr,
        };
        brook_cuda::grouped::moe(
            g,
            mats,
            shared,
            self.tab.ptr,
            m.sel,
            m.wts,
            k,
            tokens,
            m.sg,
            m.sgs,
            m.x,
            hd.ptr,
            hsd.ptr,
            out.ptr,
            w,
        )
        .expect("grouped");
        Some(out.read().expect("read"))
    }
}

fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

/// One token through routed experts (laid out in slots behind a table, as the engine does)
/// and a shared expert with the two decode launches, against the reference's products.
#[test]
fn one_token_moe_kernels_match_the_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(13);
    // The last two take the tensor-core kernels (tc_fits asserts it).
    for (bits, group, float, h, i, is, k) in [
        (4, 32, DType::BF16, 256, 512, 512, 8),
        (8, 32, DType::BF16, 128, 96, 64, 10),
        (4, 32, DType::BF16, 64, 32, 48, 3),
        (4, 64, DType::BF16, 512, 512, 512, 8),
        (4, 128, DType::F16, 1024, 512, 1024, 10),
    ] {
        let fmt = Format::Affine { bits, group, float };
        let case = MoeCase::new(&g, &mut rng, fmt, h, i, is);
        let (experts, shared, tab, sm) = (&case.experts, &case.shared, &case.tab, case.sm);
        let [pg, pu, pd] = &case.placed;
        let e = experts.len();
        let sel: Vec<i32> = (0..e as i32).filter(|n| n % 5 != 1).take(k).collect();
        assert_eq!(sel.len(), k);
        let wts = rng.vec(k, 1.0);
        let sg = rng.f32() - 0.5;
        let x = rng.vec(h, 1.0);
        // Reference: Σ w_k · down_k(silu(gate_k x) · up_k x) + sigmoid(sg) · shared.
        let ffn = |ls: [brook_core::linear::LinearRef<'_>; 3]| {
            let (mut gt, mut u) = (vec![0.0; ls[0].out_features], vec![0.0; ls[1].out_features]);
            ls[0].forward_rows(&x, &mut gt);
            ls[1].forward_rows(&x, &mut u);
            let hh: Vec<f32> = gt.iter().zip(&u).map(|(a, b)| silu(*a) * b).collect();
            let mut y = vec![0.0; h];
            ls[2].forward_rows(&hh, &mut y);
            y
        };
        let mut want = vec![0.0f32; h];
        for (n, &id) in sel.iter().enumerate() {
            let y = ffn(experts[id as usize].each_ref().map(|l| l.view()));
            for (o, v) in want.iter_mut().zip(y) {
                *o += wts[n] * v;
            }
        }
        let ys = ffn(shared.each_ref().map(|l| l.view()));
        let gate = 1.0 / (1.0 + (-sg).exp());
        for (o, v) in want.iter_mut().zip(ys) {
            *o += gate * v;
        }
        let xd = g.upload(&x, "x").expect("x");
        let seld = g.upload(&sel, "sel").expect("sel");
        let wd = g.upload(&wts, "wts").expect("wts");
        let sgd = g.upload(&[sg], "sg").expect("sg");
        // The plain form first: every gate and up output.
        let gu = g.zeros(k * 2 * i * 4, "gu").expect("gu");
        let sgu = g.zeros(2 * is * 4, "sgu").expect("sgu");
        ops::qmv_experts(
            &g,
            pg.mat,
            pu.mat,
            tab.ptr,
            seld.ptr,
            k,
            k as i32,
            [sm[0], sm[1]],
            false,
            1,
            xd.ptr,
            gu.ptr,
            sgu.ptr,
            None,
        )
        .expect("gate/up");
        let mut want_gu = Vec::new();
        for &id in &sel {
            for l in &experts[id as usize][..2] {
                let mut y = vec![0.0; i];
                l.view().forward_rows(&x, &mut y);
                want_gu.extend(y);
            }
        }
        let got_gu: Vec<f32> = gu.read().expect("read");
        assert!(rel_l2(&got_gu, &want_gu) < 1e-5, "gate/up");
        // The decode form: SwiGLU in the first launch, downs and the sum in the second, on
        // the tensor cores where they fit and on the CUDA cores.
        assert!(ops::moe_down_fits(&pd.mat, &sm[2], k));
        if group >= 64 {
            for m in [pg.mat, pu.mat, sm[0], sm[1]] {
                assert!(ops::tc_fits(&m, 8));
            }
            assert!(ops::tc_fits(&pd.mat, 16) && ops::tc_fits(&sm[2], 16));
        }
        for tc in [true, false] {
            g.use_tensor_cores(tc);
            let m = MoeIn {
                k,
                tokens: 1,
                x: xd.ptr,
                sel: seld.ptr,
                wts: wd.ptr,
                sg: sgd.ptr,
                sgs: 0,
            };
            let got = case.decode(&g, m);
            let err = rel_l2(&got, &want);
            assert!(
                err < 1e-5,
                "{bits}-bit g{group} h={h} i={i} k={k} tc={tc}: rel err {err}"
            );
        }
    }
    g.use_tensor_cores(true);
}

/// Random delta-rule inputs in the engine's layout, shaped like the model's: q of norm
/// dk^-1/2 and k of norm 1 (what delta_prep leaves), g = -e^u with u in [-5, 1), β in
/// (0.12, 0.88), a random entering state, nv = 2·nk value heads.
fn delta_case(
    rng: &mut Rng,
    t: usize,
    nk: usize,
    dk: usize,
    dv: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (nv, key_dim) = (2 * nk, nk * dk);
    let cd = 2 * key_dim + nv * dv;
    let mut conv = rng.vec(t * cd, 1.0);
    for row in conv.chunks_exact_mut(cd) {
        for (hh, head) in row[..2 * key_dim].chunks_exact_mut(dk).enumerate() {
            let norm = head.iter().map(|x| x * x).sum::<f32>().sqrt();
            let norm = if hh < nk {
                norm * (dk as f32).sqrt()
            } else {
                norm
            };
            head.iter_mut().for_each(|x| *x /= norm);
        }
    }
    let g = (0..t * nv)
        .map(|_| -(3.0 * rng.f32() - 2.0).exp())
        .collect();
    let beta = (0..t * nv)
        .map(|_| 1.0 / (1.0 + (-2.0 * rng.f32()).exp()))
        .collect();
    (conv, g, beta)
}

/// Both delta-rule kernels, the token-by-token one and the chunked one (64 tokens a chunk),
/// against the reference recurrence on random inputs: T within one chunk, on its edge, one
/// past it and several chunks with a ragged last one; the real head size (dk = dv = 128),
/// dk = 128 with 40 value columns, and smaller ones that take the other kernels (dk 64, 32
/// and the generic 48, with value widths that leave a partial 32-column tile). Outputs and
/// the final state within 1e-5 relative L2: the chunked form's decays e^(γi−γj) from
/// cumulative sums cost up to about 1e-6 (brook_core's chunked form on these inputs: at
/// most 1.3e-6 of the recurrence; a CPU emulation of this kernel: at most 1.7e-6 of an f64
/// recurrence). The token-by-token kernel at dk = 128 runs with each state column in one
/// lane, and split over two and four.
#[test]
fn delta_rule_kernels_match_the_reference_recurrence() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(17);
    for (nk, dk, dv) in [
        (2, 128, 128),
        (1, 128, 40),
        (1, 64, 64),
        (1, 32, 48),
        (2, 48, 40),
    ] {
        let (nv, key_dim) = (2 * nk, nk * dk);
        let cd = 2 * key_dim + nv * dv;
        for t in [1usize, 7, 64, 65, 200, 300] {
            let (conv, gl, beta) = delta_case(&mut rng, t, nk, dk, dv);
            let s0 = rng.vec(nv * dk * dv, 0.5);
            // The reference reads q, k [T, nk, dk] and v [T, nv, dv].
            let cols = |lo: usize, n: usize| -> Vec<f32> {
                conv.chunks_exact(cd)
                    .flat_map(|r| r[lo..lo + n].to_vec())
                    .collect()
            };
            let (q, k, v) = (
                cols(0, key_dim),
                cols(key_dim, key_dim),
                cols(2 * key_dim, nv * dv),
            );
            let inputs = DeltaInputs {
                q: &q,
                k: &k,
                v: &v,
                g: &gl,
                beta: &beta,
                nk,
                nv,
                dk,
                dv,
            };
            let (mut s_ref, mut o_ref) = (s0.clone(), vec![0.0; t * nv * dv]);
            delta_rule_recurrent(&inputs, &mut s_ref, &mut o_ref);
            let convd = g.upload(&conv, "conv").expect("conv");
            let gd = g.upload(&gl, "g").expect("g");
            let bd = g.upload(&beta, "beta").expect("beta");
            let modes = [
                (DeltaMode::Recurrent, 1),
                (DeltaMode::Recurrent, 2),
                (DeltaMode::Recurrent, 4),
                (DeltaMode::Chunked, 1),
            ];
            for (mode, split) in modes {
                if split > 1 && dk != 128 {
                    continue;
                }
                g.split_rule(split);
                let sd = g.upload(&s0, "state").expect("state");
                let od = g.upload(&vec![f32::NAN; t * nv * dv], "o").expect("o");
                let rule = DeltaRule {
                    conv: convd.ptr,
                    g: gd.ptr,
                    beta: bd.ptr,
                    state: sd.ptr,
                    o: od.ptr,
                    t,
                    cd,
                    nk,
                    nv,
                    dk,
                    dv,
                    seqs: 0,
                    nseq: 1,
                    prep: None,
                    prep_in_rule: false,
                    norm: None,
                    norm_in_rule: false,
                };
                delta_rule(&g, &rule, mode).expect("launch");
                let (o, s): (Vec<f32>, Vec<f32>) = (od.read().expect("o"), sd.read().expect("s"));
                let (eo, es) = (rel_l2(&o, &o_ref), rel_l2(&s, &s_ref));
                let what = format!("{mode:?} split {split} nk={nk} dk={dk} dv={dv} t={t}");
                eprintln!("{what}: output {eo:.2e}, state {es:.2e}");
                assert!(
                    eo < 1e-5 && es < 1e-5,
                    "{what}: output {eo:.2e}, state {es:.2e}"
                );
            }
        }
    }
}

/// The token-by-token rule preparing its token itself (q/k head norms, β and g) and norming
/// and gating its outputs itself (`BROOK_CUDA_RULE_PREP=1`, `BROOK_CUDA_RULE_NORM=1`) gives
/// the bits of `delta_prep` launched before it and `gated_norm` after it, each fold alone
/// too: one sequence of one and of three tokens, and three sequences of one token each (the
/// batched step's form), at the real head size (its state columns in one lane each, and
/// split over two and over four) and at the generic kernel's (dk 48, dv 40: a partial warp).
#[test]
fn the_rule_folding_its_prep_and_norm_keeps_the_bits_of_their_launches() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(29);
    let shapes = [
        (2, 128, 128, 1),
        (2, 128, 128, 2),
        (2, 128, 128, 4),
        (2, 48, 40, 1),
    ];
    for (nk, dk, dv, split) in shapes {
        g.split_rule(split);
        let (nv, key_dim) = (2 * nk, nk * dk);
        let cd = 2 * key_dim + nv * dv;
        for (t, nseq) in [(1usize, 0usize), (3, 0), (1, 3)] {
            let tokens = t.max(nseq);
            // Each token's [b; a] row and its gates z, `bs` and `zs` floats apart.
            let (bs, zs) = (2 * nv + 3, nv * dv + 5);
            let conv = rng.vec(tokens * cd, 1.5);
            let ba = rng.vec(tokens * bs, 2.0);
            let z = rng.vec(tokens * zs, 2.0);
            let (a_log, dt_bias, w) = (rng.vec(nv, 1.0), rng.vec(nv, 1.0), rng.vec(dv, 1.0));
            let s0 = rng.vec(tokens * nv * dk * dv, 0.5);
            let up = |v: &[f32], what: &str| g.upload(v, what).expect("upload");
            let (bad, zd, ld) = (up(&ba, "b, a"), up(&z, "z"), up(&a_log, "A_log"));
            let (dd, wd) = (up(&dt_bias, "dt_bias"), up(&w, "norm weight"));
            let run = |prep_in_rule: bool, norm_in_rule: bool| -> (Vec<f32>, Vec<f32>) {
                let convd = up(&conv, "conv");
                let sd = up(&s0, "state");
                let nan = |n: usize, what: &str| up(&vec![f32::NAN; n], what);
                let (od, yd) = (nan(tokens * nv * dv, "o"), nan(tokens * nv * dv, "y"));
                let (gd, betad) = (nan(tokens * nv, "g"), nan(tokens * nv, "beta"));
                // Sequence z's state is the z-th of `s0`'s blocks (the conv state unused).
                let per = (nv * dk * dv * 4) as u64;
                let tab: Vec<u64> = (0..nseq as u64)
                    .flat_map(|z| [0, sd.ptr + z * per])
                    .collect();
                let tabd = g.upload(&tab, "seqs").expect("seqs");
                let rule = DeltaRule {
                    conv: convd.ptr,
                    g: gd.ptr,
                    beta: betad.ptr,
                    state: sd.ptr,
                    o: od.ptr,
                    t,
                    cd,
                    nk,
                    nv,
                    dk,
                    dv,
                    seqs: if nseq > 0 { tabd.ptr } else { 0 },
                    nseq: nseq.max(1),
                    prep: Some(brook_cuda::delta::DeltaPrep {
                        b: bad.ptr,
                        a: bad.ptr + (nv as u64 + 1) * 4,
                        a_log: ld.ptr,
                        dt_bias: dd.ptr,
                        bs: bs as i32,
                    }),
                    prep_in_rule,
                    norm: Some(brook_cuda::delta::GatedNorm {
                        z: zd.ptr,
                        w: wd.ptr,
                        y: yd.ptr,
                        eps: 1e-6,
                        zs: zs as i32,
                    }),
                    norm_in_rule,
                };
                delta_rule(&g, &rule, DeltaMode::Recurrent).expect("launch");
                (yd.read().expect("y"), sd.read().expect("state"))
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let (y0, s0_out) = run(false, false);
            assert!(
                y0.iter().all(|x| x.is_finite()),
                "outputs of the launches apart"
            );
            for (p, n) in [(true, false), (false, true), (true, true)] {
                let what = format!(
                    "nk={nk} dk={dk} dv={dv} split {split} t={t} seqs={nseq} prep {p} norm {n}"
                );
                let (y, st) = run(p, n);
                assert_eq!(bits(&y), bits(&y0), "{what}: outputs");
                assert_eq!(bits(&st), bits(&s0_out), "{what}: state");
            }
        }
    }
}
