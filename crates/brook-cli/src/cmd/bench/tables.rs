//! `brook bench`'s Markdown tables: the llama-bench-style rows, the GPU rows, and the
//! streaming figures of each budget.

use brook_core::experts::budget::fmt_bytes;

use super::Row;

/// The decode test's name as llama-bench writes it: tg128, or tg128 @ d4096 with a depth.
fn tg_name(r: &Row) -> String {
    let replay = if r.routing_trace.is_some() {
        " (trace)"
    } else {
        ""
    };
    if r.depth > 0 {
        format!("tg{} @ d{}{replay}", r.n_gen, r.depth)
    } else {
        format!("tg{}{replay}", r.n_gen)
    }
}

pub(super) fn print_tables(rows: &[Row]) {
    if rows.iter().any(|r| r.gpu.is_some()) {
        println!(
            "| model | GPU budget | slots | pp{} t/s | TTFT (s) | tg{} t/s | hit rate | GB copied/token | syncs/token | HBM GB/s | H2D GB/s | limit tok/s | tg / limit |",
            rows[0].n_prompt, rows[0].n_gen
        );
        println!(
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        );
        for r in rows {
            if let Some(g) = &r.gpu {
                println!(
                    "| {} | {} | {}{}{} | {:.1} | {:.3} | {:.1} ± {:.1} | {:.1}% | {:.3} | {:.1} | {:.0} | {:.1} | {:.0} | {:.0}% |",
                    r.model,
                    fmt_bytes(g.budget_bytes),
                    g.slots,
                    if g.resident { " (all)" } else { "" },
                    if g.mapped > 0 {
                        format!(" (+{} mapped)", g.mapped)
                    } else {
                        String::new()
                    },
                    r.pp_tok_s,
                    r.ttft_s,
                    r.tg_tok_s,
                    r.tg_tok_s_sd,
                    g.hit_rate * 100.0,
                    g.bytes_copied_per_token / 1e9,
                    g.syncs_per_token,
                    g.hbm_gb_s,
                    g.h2d_gb_s,
                    g.limit_tok_s,
                    r.tg_tok_s / g.limit_tok_s.max(1e-9) * 100.0
                );
            }
        }
        println!();
    }
    println!("| model | size | budget | threads | slots | test | t/s |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in rows {
        let budget = r.budget_bytes.map_or("auto".to_string(), fmt_bytes);
        let slots = match (r.expert_slots, r.expert_slots_max) {
            (None, _) => "all".to_string(),
            (Some(s), Some(m)) if m > s => format!("{s} of {m}"),
            (Some(s), _) => s.to_string(),
        };
        for (test, m, sd) in [
            (format!("pp{}", r.n_prompt), r.pp_tok_s, r.pp_tok_s_sd),
            (tg_name(r), r.tg_tok_s, r.tg_tok_s_sd),
        ] {
            println!(
                "| {} | {} | {budget} | {} | {slots} | {test} | {m:.2} ± {sd:.2} |",
                r.model,
                fmt_bytes(r.model_bytes),
                r.threads
            );
        }
    }
    println!();
    println!(
        "| budget | TTFT (s) | peak RSS | hit rate | GB read/token | GB touched/token: weights + state | disk GB/s (achieved / measured) | mem GB/s | limit tok/s | tg / limit | ms/token: decode, read, compute | decode / max(read, compute) |"
    );
    println!(
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for r in rows {
        let decode_s = if r.tg_tok_s > 0.0 {
            1.0 / r.tg_tok_s
        } else {
            0.0
        };
        let bound = r.read_s_per_token.max(r.compute_s_per_token);
        println!(
            "| {} | {:.2} | {} | {:.1}% | {:.3} | {:.3} + {:.3} | {:.2} / {:.2} | {:.1} | {:.2} | {:.0}% | {:.0}, {:.0}, {:.0} | {:.2}x |",
            r.budget_bytes.map_or("auto".to_string(), fmt_bytes),
            r.ttft_s,
            fmt_bytes(r.peak_rss_bytes),
            r.hit_rate * 100.0,
            r.bytes_read_per_token / 1e9,
            r.bytes_touched_per_token / 1e9,
            r.state_bytes_per_token / 1e9,
            r.disk_gb_s,
            r.disk_bw_gb_s,
            r.mem_bw_gb_s,
            r.limit_tok_s,
            if r.limit_tok_s > 0.0 {
                r.tg_tok_s / r.limit_tok_s * 100.0
            } else {
                0.0
            },
            decode_s * 1e3,
            r.read_s_per_token * 1e3,
            r.compute_s_per_token * 1e3,
            if bound > 0.0 { decode_s / bound } else { 0.0 }
        );
    }
}
