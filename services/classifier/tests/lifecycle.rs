//! The classifier against the testbed: ready on /readyz (partitions assigned, database migrated
//! and reachable), clean exit on SIGTERM, and a bad config refused with every problem listed.

use std::time::Duration;

use gpumedic_testkit as testkit;

const BIN: &str = env!("CARGO_BIN_EXE_gpumedic-classifier");

#[tokio::test]
async fn starts_reports_ready_and_stops_on_sigterm() {
    let bootstrap = testkit::require_kafka().await.unwrap_or_else(|e| panic!("{e}"));
    let admin = testkit::require_postgres().await.unwrap_or_else(|e| panic!("{e}"));
    let db = testkit::unique_name("lifecycle").replace('-', "_");
    let url = testkit::fresh_database(&admin, &db).await.expect("database created");
    testkit::assert_service_lifecycle(
        BIN,
        &[],
        &[
            ("GPUMEDIC_KAFKA_BOOTSTRAP", bootstrap),
            ("GPUMEDIC_GROUP", testkit::unique_name("classifier")),
            ("GPUMEDIC_DATABASE_URL", url),
        ],
        Duration::from_secs(60),
        Duration::from_secs(10),
    )
    .await;
}

#[test]
fn invalid_config_lists_every_problem_and_exits_64() {
    let (code, stderr) = testkit::run_with_invalid_config(
        BIN,
        &["--kafka-bootstrap", "nohost", "--database-url", "mysql://x", "--database-pool", "0"],
    );
    assert_eq!(code, Some(64), "{stderr}");
    for field in ["--kafka-bootstrap", "--database-url", "--database-pool"] {
        assert!(stderr.contains(field), "{field} missing from: {stderr}");
    }
    assert!(stderr.contains("3 problems"), "{stderr}");
}

#[test]
fn invalid_batch_retention_reload_and_topic_flags_are_each_listed() {
    let (code, stderr) = testkit::run_with_invalid_config(
        BIN,
        &[
            "--kafka-bootstrap",
            "127.0.0.1:19092",
            "--database-url",
            "postgres://u@127.0.0.1/db",
            "--batch-max",
            "0",
            "--batch-linger",
            "1h",
            "--event-retention",
            "2h",
            "--rules-poll",
            "0s",
            "--verdicts-topic",
            "bad topic!",
            "--write-parallelism",
            "9",
            "--rollup-period",
            "7m",
        ],
    );
    assert_eq!(code, Some(64), "{stderr}");
    for field in [
        "--batch-max",
        "--batch-linger",
        "--event-retention",
        "--rules-poll",
        "--verdicts-topic",
        "--write-parallelism",
        "--rollup-period",
    ] {
        assert!(stderr.contains(field), "{field} missing from: {stderr}");
    }
    assert!(stderr.contains("does not divide an hour"), "{stderr}");
    assert!(stderr.contains("7 problems"), "{stderr}");
}

#[test]
fn invalid_api_auth_flags_are_each_listed() {
    let (code, stderr) = testkit::run_with_invalid_config(
        BIN,
        &[
            "--kafka-bootstrap",
            "127.0.0.1:19092",
            "--database-url",
            "postgres://u@127.0.0.1/db",
            "--api-auth",
            "off",
            "--api-auth-cache-ttl",
            "1h",
            "--api-auth-cache-size",
            "0",
        ],
    );
    assert_eq!(code, Some(64), "{stderr}");
    for (field, why) in [
        ("--api-auth", "kubernetes or none"),
        ("--api-auth-cache-ttl", "at most 5m"),
        ("--api-auth-cache-size", "from 1 to 100000"),
    ] {
        assert!(stderr.contains(&format!("{field}: ")) && stderr.contains(why), "{field} missing from: {stderr}");
    }
    assert!(stderr.contains("3 problems"), "{stderr}");
}
