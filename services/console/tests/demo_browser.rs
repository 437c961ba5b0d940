//! The console in a real browser on the demo's own pipeline: `gpumedic demo --keep` runs the
//! collectors, enricher, classifier, remediator and console on the testbed and injects its fault
//! (GPU 3 of one node falls off the bus); headless Chromium follows the story on the console as it
//! happens. The fleet page lists the node out of service, its node page the open incident, the
//! incident page the story; the fleet page, open while the node is out, receives its recovery
//! verdict without a reload once the demo's simulated reboot has proved the repair; then the node
//! is back in service on the fleet page. Screenshots go to `target/console-screenshots/demo-*.png`.
//!
//! Needs the testbed, every binary (`cargo build --workspace --bins`) and Chromium
//! (`compose/lib/install-chromium.sh`; `scripts/test.sh` runs both).

mod support;

use std::time::Duration;

use gpumedic_testkit::demo::Demo;
use support::browser::{Browser, screenshot_dir};

/// The text after `prefix` in `line`, up to the next space (or the end).
fn word_after<'a>(line: &'a str, prefix: &str) -> &'a str {
    let at = line.find(prefix).unwrap_or_else(|| panic!("{prefix:?} is not in {line:?}")) + prefix.len();
    line[at..].split_whitespace().next().unwrap_or_default()
}

#[test]
fn a_browser_follows_the_demo_story_on_the_console_as_it_happens() {
    let mut demo = Demo::start(&["--keep"]);
    let dir = screenshot_dir();
    let line = demo.wait_for_line("Open the console to watch the story on the fleet page: ", Duration::from_secs(300));
    let base = word_after(&line, "fleet page: ").trim_end_matches('/').to_owned();

    let mut b = Browser::start();
    let has = |b: &mut Browser, selector: &str, text: &str| {
        b.eval(&format!("(document.querySelector({selector:?}) || {{textContent: ''}}).textContent.includes({text:?})"))
            == serde_json::json!(true)
    };
    let line = demo.wait_for_line("Injecting a fault: GPU 3 of ", Duration::from_secs(120));
    let faulty = word_after(&line, "GPU 3 of ").to_owned();

    // Once the demo has seen the console count the node out, every page shows it, before the
    // demo's wait of more than the quiet period ends and its simulated reboot begins.
    demo.wait_for_line("the console shows it:", Duration::from_secs(120));
    b.open(&format!("{base}/"));
    assert!(has(&mut b, "#out-of-service", &faulty), "the fleet page lists the quarantined node");
    b.screenshot(&dir.join("demo-fleet.png"));

    b.open(&format!("{base}/nodes/{faulty}"));
    assert!(has(&mut b, "#open-incidents", "xid-79-fallen-off-the-bus"), "the node page shows the open incident");
    let incident = b.eval("(document.querySelector('#open-incidents a[href^=\"/incidents/\"]') || {}).href || ''");
    let incident = incident.as_str().unwrap_or_default().to_owned();
    assert!(!incident.is_empty(), "the node page links its open incident");
    b.screenshot(&dir.join("demo-node.png"));

    b.open(&incident);
    assert!(has(&mut b, "#story", "Xid 79"), "the incident page tells the story from the evidence");
    b.screenshot(&dir.join("demo-incident.png"));

    // The fleet page, open while the node is out: the recovery verdict the demo's simulated reboot
    // leads to (at least the demo's 30 s wait away) must arrive in it without a reload. The live
    // list is filled only by the page's event stream, never rendered by the server.
    b.open(&format!("{base}/"));
    b.wait_for("document.getElementById('live').getAttribute('data-live') === 'open'", Duration::from_secs(30));
    b.eval("window.gpumedicTestMarker = 'before'");
    b.wait_for(
        &format!("document.querySelector('li.live-verdict[data-node=\"{faulty}\"]') !== null"),
        Duration::from_secs(180),
    );
    assert_eq!(b.eval("window.gpumedicTestMarker"), serde_json::json!("before"), "the fleet page was reloaded");
    assert!(has(&mut b, "#live", "recovered"), "the live verdict is the node's recovery");
    b.screenshot(&dir.join("demo-fleet-live.png"));

    // The reboot is the proof of repair: after it the node is back in service on the fleet page.
    demo.wait_for_line("released once (one recovery verdict)", Duration::from_secs(300));
    // (The console's node cache follows the apiserver's watch: reload for a few seconds.)
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        b.open(&format!("{base}/"));
        if !has(&mut b, "#out-of-service", &faulty) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the recovered node is still listed out of service");
        std::thread::sleep(Duration::from_millis(500));
    }
    b.screenshot(&dir.join("demo-fleet-recovered.png"));
    drop(b);

    demo.wait_for_line("press Ctrl-C to stop them", Duration::from_secs(120));
    demo.signal("INT");
    demo.wait(Duration::from_secs(90));
    let out = demo.output();
    assert!(out.contains("Removing what run"), "the demo did not clean up after Ctrl-C:\n{out}");
    println!("screenshots in {}", dir.display());
}
