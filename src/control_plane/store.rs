//! The control plane's state in SQLite: desired state per cluster, node registrations with
//! their last report, and a bounded history of reports. The schema is versioned with
//! `PRAGMA user_version`; [`MIGRATIONS`] brings any older file up to date at open.

use std::path::Path;

use rusqlite::{Connection, OptionalExtension, params};

use super::wire::{DesiredState, Report};

/// Schema migrations, in order: entry `i` takes a database from version `i` to `i + 1`.
pub const MIGRATIONS: &[&str] = &[
    // 1: clusters, nodes, reports.
    "CREATE TABLE clusters (
        name TEXT PRIMARY KEY,
        desired TEXT NOT NULL,
        updated_ms INTEGER NOT NULL
    );
    CREATE TABLE nodes (
        cluster TEXT NOT NULL,
        node TEXT NOT NULL,
        registered_ms INTEGER NOT NULL,
        last_seen_ms INTEGER NOT NULL,
        last_report TEXT NOT NULL,
        PRIMARY KEY (cluster, node)
    );
    CREATE TABLE reports (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        cluster TEXT NOT NULL,
        node TEXT NOT NULL,
        at_ms INTEGER NOT NULL,
        report TEXT NOT NULL
    );
    CREATE INDEX reports_by_node ON reports (cluster, node, id);",
];

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the database {path}: {source}")]
    Open {
        path: String,
        source: rusqlite::Error,
    },
    #[error(
        "the database {path} has schema version {found}, newer than this moe-node knows ({known}): use the moe-node that wrote it"
    )]
    TooNew {
        path: String,
        found: i64,
        known: usize,
    },
    #[error("database: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("a stored value is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// One node as the control plane last heard from it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NodeRecord {
    pub cluster: String,
    pub node: String,
    pub registered_ms: i64,
    pub last_seen_ms: i64,
    pub report: Report,
}

pub struct Store {
    db: Connection,
    history_per_node: usize,
}

impl Store {
    /// Opens (or creates) the database at `path` and migrates it to the current schema.
    pub fn open(path: &Path, history_per_node: usize) -> Result<Store, StoreError> {
        let shown = path.display().to_string();
        let mut db = Connection::open(path).map_err(|source| StoreError::Open {
            path: shown.clone(),
            source,
        })?;
        // WAL: readers (the status page) do not wait for a writer; NORMAL sync is durable
        // across a process crash, which is what a restart needs.
        db.pragma_update(None, "journal_mode", "WAL")
            .and_then(|_| db.pragma_update(None, "synchronous", "NORMAL"))
            .and_then(|_| db.busy_timeout(std::time::Duration::from_secs(5)))
            .map_err(|source| StoreError::Open {
                path: shown.clone(),
                source,
            })?;
        let version: i64 = db.pragma_query_value(None, "user_version", |row| row.get(0))?;
        if version > MIGRATIONS.len() as i64 {
            return Err(StoreError::TooNew {
                path: shown,
                found: version,
                known: MIGRATIONS.len(),
            });
        }
        for (done, migration) in MIGRATIONS.iter().enumerate().skip(version.max(0) as usize) {
            let tx = db.transaction()?;
            tx.execute_batch(migration)?;
            tx.pragma_update(None, "user_version", done as i64 + 1)?;
            tx.commit()?;
            tracing::info!(version = done + 1, "database schema migrated");
        }
        Ok(Store {
            db,
            history_per_node: history_per_node.max(1),
        })
    }

    /// The desired state of `cluster` (the default, version 0, if none was set).
    pub fn desired(&self, cluster: &str) -> Result<DesiredState, StoreError> {
        let text: Option<String> = self
            .db
            .query_row(
                "SELECT desired FROM clusters WHERE name = ?1",
                params![cluster],
                |row| row.get(0),
            )
            .optional()?;
        Ok(match text {
            Some(text) => serde_json::from_str(&text)?,
            None => DesiredState::default(),
        })
    }

    /// Replaces the desired state of `cluster`, one version up; returns what is stored.
    pub fn set_desired(
        &self,
        cluster: &str,
        mut desired: DesiredState,
        now_ms: i64,
    ) -> Result<DesiredState, StoreError> {
        desired.version = self.desired(cluster)?.version + 1;
        self.db.execute(
            "INSERT INTO clusters (name, desired, updated_ms) VALUES (?1, ?2, ?3)
             ON CONFLICT (name) DO UPDATE SET desired = ?2, updated_ms = ?3",
            params![cluster, serde_json::to_string(&desired)?, now_ms],
        )?;
        Ok(desired)
    }

    /// Records a node's report (registering it the first time), keeping at most
    /// `history_per_node` reports of it. Returns whether the node was new.
    pub fn record(&mut self, report: &Report, now_ms: i64) -> Result<bool, StoreError> {
        let text = serde_json::to_string(report)?;
        let tx = self.db.transaction()?;
        let known: bool = tx
            .query_row(
                "SELECT 1 FROM nodes WHERE cluster = ?1 AND node = ?2",
                params![report.cluster, report.node],
                |_| Ok(()),
            )
            .optional()?
            .is_some();
        tx.execute(
            "INSERT INTO nodes (cluster, node, registered_ms, last_seen_ms, last_report)
             VALUES (?1, ?2, ?3, ?3, ?4)
             ON CONFLICT (cluster, node) DO UPDATE SET last_seen_ms = ?3, last_report = ?4",
            params![report.cluster, report.node, now_ms, text],
        )?;
        tx.execute(
            "INSERT INTO reports (cluster, node, at_ms, report) VALUES (?1, ?2, ?3, ?4)",
            params![report.cluster, report.node, now_ms, text],
        )?;
        tx.execute(
            "DELETE FROM reports WHERE cluster = ?1 AND node = ?2 AND id NOT IN (
                SELECT id FROM reports WHERE cluster = ?1 AND node = ?2
                ORDER BY id DESC LIMIT ?3)",
            params![report.cluster, report.node, self.history_per_node as i64],
        )?;
        tx.commit()?;
        Ok(!known)
    }

    /// Why a report from `node` of `cluster` would make the store grow past its bounds, or
    /// `None` when it may be recorded (a known node always may).
    pub fn growth_refused(
        &self,
        cluster: &str,
        node: &str,
        max_clusters: usize,
        max_nodes_per_cluster: usize,
    ) -> Result<Option<String>, StoreError> {
        let count = |sql: &str, args: &[&str]| -> Result<usize, StoreError> {
            let n: i64 =
                self.db
                    .query_row(sql, rusqlite::params_from_iter(args.iter()), |row| {
                        row.get(0)
                    })?;
            Ok(usize::try_from(n).unwrap_or(usize::MAX))
        };
        if count(
            "SELECT COUNT(*) FROM nodes WHERE cluster = ?1 AND node = ?2",
            &[cluster, node],
        )? > 0
        {
            return Ok(None);
        }
        let nodes = count("SELECT COUNT(*) FROM nodes WHERE cluster = ?1", &[cluster])?;
        if nodes >= max_nodes_per_cluster {
            return Ok(Some(format!(
                "cluster {cluster} has {nodes} nodes, max_nodes_per_cluster"
            )));
        }
        self.cluster_growth_refused(cluster, max_clusters)
    }

    /// Why naming `cluster` would keep more than `max_clusters`, or `None`.
    pub fn cluster_growth_refused(
        &self,
        cluster: &str,
        max_clusters: usize,
    ) -> Result<Option<String>, StoreError> {
        let clusters = self.clusters()?;
        if clusters.len() >= max_clusters && !clusters.iter().any(|c| c == cluster) {
            return Ok(Some(format!(
                "{} clusters are kept already, max_clusters",
                clusters.len()
            )));
        }
        Ok(None)
    }

    /// Every cluster named by a desired state or a node.
    pub fn clusters(&self) -> Result<Vec<String>, StoreError> {
        let mut stmt = self
            .db
            .prepare("SELECT name FROM clusters UNION SELECT cluster FROM nodes ORDER BY 1")?;
        let names = stmt
            .query_map([], |row| row.get(0))?
            .collect::<Result<Vec<String>, _>>()?;
        Ok(names)
    }

    /// The nodes of `cluster`, by name.
    pub fn nodes(&self, cluster: &str) -> Result<Vec<NodeRecord>, StoreError> {
        let mut stmt = self.db.prepare(
            "SELECT node, registered_ms, last_seen_ms, last_report FROM nodes
             WHERE cluster = ?1 ORDER BY node",
        )?;
        let rows = stmt
            .query_map(params![cluster], |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, i64>(1)?,
                    row.get::<_, i64>(2)?,
                    row.get::<_, String>(3)?,
                ))
            })?
            .collect::<Result<Vec<_>, _>>()?;
        rows.into_iter()
            .map(|(node, registered_ms, last_seen_ms, report)| {
                Ok(NodeRecord {
                    cluster: cluster.to_string(),
                    node,
                    registered_ms,
                    last_seen_ms,
                    report: serde_json::from_str(&report)?,
                })
            })
            .collect()
    }

    /// A node's stored reports, newest first.
    pub fn history(&self, cluster: &str, node: &str) -> Result<Vec<(i64, Report)>, StoreError> {
        let mut stmt = self.db.prepare(
            "SELECT at_ms, report FROM reports WHERE cluster = ?1 AND node = ?2 ORDER BY id DESC",
        )?;
        let rows = stmt
            .query_map(params![cluster, node], |row| {
                Ok((row.get::<_, i64>(0)?, row.get::<_, String>(1)?))
            })?
            .collect::<Result<Vec<_>, _>>()?;
        rows.into_iter()
            .map(|(at, text)| Ok((at, serde_json::from_str(&text)?)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire_key() -> crate::control_plane::wire::SaltedKey {
        crate::control_plane::wire::SaltedKey::new("a-long-enough-api-key")
    }

    fn report(node: &str, in_flight: usize) -> Report {
        Report {
            cluster: "c1".into(),
            node: node.into(),
            in_flight,
            ..Report::default()
        }
    }

    #[test]
    fn state_survives_reopening_and_history_stays_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.db");
        {
            let mut store = Store::open(&path, 3).unwrap();
            assert!(store.record(&report("n1", 0), 10).unwrap());
            for i in 1..10 {
                assert!(!store.record(&report("n1", i), 10 + i as i64).unwrap());
            }
            let desired = DesiredState {
                api_keys: vec![wire_key()],
                ..DesiredState::default()
            };
            assert_eq!(
                store.set_desired("c1", desired.clone(), 5).unwrap().version,
                1
            );
            assert_eq!(store.set_desired("c1", desired, 6).unwrap().version, 2);
        }
        let store = Store::open(&path, 3).unwrap();
        assert_eq!(store.desired("c1").unwrap().version, 2);
        assert_eq!(store.clusters().unwrap(), vec!["c1"]);
        let nodes = store.nodes("c1").unwrap();
        assert_eq!(nodes.len(), 1);
        assert_eq!(nodes[0].report.in_flight, 9);
        let history = store.history("c1", "n1").unwrap();
        assert_eq!(
            history.iter().map(|(_, r)| r.in_flight).collect::<Vec<_>>(),
            vec![9, 8, 7]
        );
        assert_eq!(store.desired("other").unwrap(), DesiredState::default());
    }

    #[test]
    fn growth_past_the_bounds_is_refused_but_known_nodes_report_on() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(&dir.path().join("state.db"), 3).unwrap();
        for node in ["n1", "n2"] {
            assert_eq!(store.growth_refused("c1", node, 2, 2).unwrap(), None);
            store.record(&report(node, 0), 1).unwrap();
        }
        let full = store.growth_refused("c1", "n3", 2, 2).unwrap();
        assert!(full.is_some_and(|why| why.contains("max_nodes_per_cluster")));
        assert_eq!(store.growth_refused("c1", "n1", 2, 2).unwrap(), None);
        store.set_desired("c2", DesiredState::default(), 1).unwrap();
        let many = store.growth_refused("c3", "n1", 2, 2).unwrap();
        assert!(many.is_some_and(|why| why.contains("max_clusters")));
        assert_eq!(store.growth_refused("c2", "n1", 2, 2).unwrap(), None);
    }

    #[test]
    fn a_database_from_a_newer_moe_node_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.db");
        Connection::open(&path)
            .unwrap()
            .pragma_update(None, "user_version", 99)
            .unwrap();
        let e = Store::open(&path, 3).err().unwrap().to_string();
        assert!(e.contains("schema version 99"), "{e}");
    }
}
