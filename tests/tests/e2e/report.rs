//! The compliance report: built from a real audit root written by a real prefill/decode pair,
//! self-contained, and rendered by headless Chromium into a screenshot that is not blank.

use std::sync::Arc;
use std::time::Duration;

use custody_runtime::config::UnsafeReproduction;

use crate::disagg::{Writers, cfg, req, start_pair_with};

/// Chromium's binary (Debian package `chromium`, installed by scripts/setup.sh).
fn chromium() -> std::path::PathBuf {
    for p in ["/usr/bin/chromium", "/usr/bin/chromium-browser"] {
        if std::path::Path::new(p).exists() {
            return p.into();
        }
    }
    panic!("chromium not found: run scripts/setup.sh (apt package `chromium`)");
}

#[test]
fn compliance_report_is_self_contained_and_renders_in_headless_chromium() {
    let root = std::env::temp_dir().join(format!("custody-report-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let key = custody_audit::digest::generate_key().expect("key");
    let open = |node| {
        Arc::new(
            custody_audit::writer::AuditWriter::open(custody_audit::writer::WriterConfig::new(
                &root,
                node,
                key.clone(),
            ))
            .expect("writer"),
        )
    };
    let (pw, dw) = (open(1), open(2));
    let sinks: Writers = (pw.clone(), dw.clone());
    let nodes = start_pair_with(
        cfg(1024, 32),
        cfg(1024, 32),
        UnsafeReproduction::default(),
        Duration::from_secs(30),
        Some(sinks),
    );
    for (i, tenant) in ["acme", "globex", "initech", "acme", "acme"]
        .iter()
        .enumerate()
    {
        let prompt: Vec<u32> = (0..40 + 30 * i as u32).map(|t| 300 + t * 11).collect();
        nodes
            .pair
            .generate(&req(tenant, prompt, 4))
            .expect("served");
    }
    // An over-length prompt: rejected on admission, and in the report.
    let long: Vec<u32> = (0..1100u32).map(|t| 300 + t % 900).collect();
    assert!(nodes.pair.generate(&req("globex", long, 4)).is_err());
    drop(nodes);
    pw.close().expect("seal");
    dw.close().expect("seal");

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let html = rt.block_on(async {
        let vs = custody_query::session_over_verified(&root, None)
            .await
            .expect("session");
        assert!(vs.report.ok(), "{:?}", vs.report.problems);
        custody_query::prepare_forensics(&vs.ctx)
            .await
            .expect("views");
        let scope = custody_query::report::ReportScope {
            root: root.display().to_string(),
            from_ns: None,
            to_ns: None,
            generated_ns: 1_764_460_800_000_000_000,
        };
        custody_query::report::render(&vs, &scope)
            .await
            .expect("report")
    });
    // Self-contained: no script, no external resource of any kind.
    for banned in ["<script", "http://", "https://", "src=", "@import", "url("] {
        assert!(!html.contains(banned), "report contains {banned:?}");
    }
    for section in [
        "The audit log's own verification",
        "Exposure: who could have seen whose data",
        "Integrity violations by kind",
        "KV transfer outcomes",
        "Requests admitted over time",
        "Tokens served over time",
        "Request latency",
    ] {
        assert!(html.contains(section), "report lacks {section:?}");
    }
    assert!(html.matches("<svg").count() >= 4, "charts are missing");
    // The figures are the log's: 5 served + 1 rejected on the front door, none exposed.
    assert!(html.contains(">valid<") && html.contains("acme") && html.contains("initech"));

    let page = root.join("report.html");
    std::fs::write(&page, &html).expect("write");
    let png = root.join("report.png");
    let out = std::process::Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1280,1800",
        ])
        .arg(format!("--screenshot={}", png.display()))
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("run chromium");
    assert!(
        png.exists(),
        "chromium wrote no screenshot: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Non-trivial: many distinct colours, and a good share of the page is not background.
    let decoder = png::Decoder::new(std::io::BufReader::new(
        std::fs::File::open(&png).expect("png"),
    ));
    let mut reader = decoder.read_info().expect("png header");
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).expect("png frame");
    assert_eq!(info.width, 1280);
    let bpp = info.line_size / info.width as usize;
    let pixels: Vec<&[u8]> = buf[..info.buffer_size()].chunks(bpp).collect();
    let distinct: std::collections::HashSet<&[u8]> = pixels.iter().copied().collect();
    let background = pixels[0];
    let ink = pixels.iter().filter(|p| **p != background).count();
    assert!(distinct.len() > 50, "only {} colours", distinct.len());
    assert!(
        ink * 10 > pixels.len(),
        "only {ink} of {} pixels differ from the background",
        pixels.len()
    );
    let _ = std::fs::remove_dir_all(&root);
}
