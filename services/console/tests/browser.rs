//! The console in a real browser: headless Chromium from Debian's packages against the console on
//! the testbed. The fleet page shows the quarantined node, the node page its incident, the
//! incident page its story, and a verdict published while the fleet page is open appears in it
//! without a reload. A screenshot of each page is written to `target/console-screenshots/`.

mod support;

use std::time::Duration;

use support::browser::{Browser, screenshot_dir};

#[tokio::test(flavor = "multi_thread")]
async fn a_browser_sees_the_quarantined_node_its_incident_and_a_live_verdict() {
    let fleet = support::fleet().await;
    let console = fleet.console("none").await;
    let base = format!("http://{}", console.admin_addr());
    let dir = screenshot_dir();
    let runtime = tokio::runtime::Handle::current();
    tokio::task::block_in_place(|| {
        let mut b = Browser::start();
        let has = |b: &mut Browser, selector: &str, text: &str| {
            b.eval(&format!(
                "(document.querySelector({selector:?}) || {{textContent: ''}}).textContent.includes({text:?})"
            )) == serde_json::json!(true)
        };

        b.open(&format!("{base}/"));
        assert!(has(&mut b, "#out-of-service", &fleet.quarantined), "the fleet page lists the quarantined node");
        assert!(has(&mut b, "#in-service-ratio", "66.7%"), "the fleet page shows the capacity in service");
        assert!(has(&mut b, "#remediator", "breaker open"), "the fleet page shows the open breaker");
        b.screenshot(&dir.join("fleet.png"));

        b.open(&format!("{base}/nodes?state=quarantined"));
        assert!(has(&mut b, "#nodes", &fleet.quarantined), "the node list filters by state");
        assert!(!has(&mut b, "#nodes", &fleet.other), "the node list leaves the other states out");
        b.screenshot(&dir.join("nodes.png"));

        b.open(&format!("{base}/nodes/{}", fleet.quarantined));
        let link =
            format!("document.querySelector('#open-incidents a[href=\"/incidents/{}\"]') !== null", fleet.incident);
        assert_eq!(b.eval(&link), serde_json::json!(true), "the node page links its open incident");
        assert!(has(&mut b, "#open-incidents", "xid-79-fallen-off-the-bus"), "the node page shows its incident's rule");
        assert!(has(&mut b, "#gpus", "0000:2a:00.0"), "the node page lists its GPUs");
        assert!(has(&mut b, "#events", "GpumedicQuarantined"), "the node page shows its Events");
        b.screenshot(&dir.join("node.png"));

        b.open(&format!("{base}/incidents/{}", fleet.incident));
        assert!(has(&mut b, "#story", "Xid 79"), "the incident page tells the story from the evidence");
        b.screenshot(&dir.join("incident.png"));

        // Live: the fleet page, open, hears a verdict published now; the page is not reloaded
        // (a variable set before the verdict survives).
        b.open(&format!("{base}/"));
        b.wait_for("document.getElementById('live').getAttribute('data-live') === 'open'", Duration::from_secs(20));
        b.eval("window.gpumedicTestMarker = 'before'");
        let id = runtime.block_on(fleet.publish_verdict(&fleet.other, "two double-bit ECC errors in a minute"));
        b.wait_for(&format!("document.querySelector('[data-verdict-id=\"{id}\"]') !== null"), Duration::from_secs(30));
        assert_eq!(b.eval("window.gpumedicTestMarker"), serde_json::json!("before"), "the page was reloaded");
        assert!(has(&mut b, "#live", &fleet.other), "the live verdict names its node");
        let dom = b.dom();
        std::fs::write(dir.join("fleet-live.html"), &dom).expect("write the DOM");
        b.screenshot(&dir.join("fleet-live.png"));
    });
    println!("screenshots in {}", dir.display());
}
