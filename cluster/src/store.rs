//! [`NamedOnly`]: every object store a cluster process opens, with listing refused.
//!
//! The querying process names every file the cluster may read (the verified files, the scratch
//! files it listed itself). DataFusion's listing table looks an explicit file up with a HEAD and,
//! when that finds nothing, *lists* under the file's name as if it were a directory — which
//! would turn a missing file into an empty table (a silently smaller answer), or read whatever
//! was put under that name. On the cluster a listing is an error instead: a file that is not
//! there fails the query.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};

#[derive(Debug)]
pub(crate) struct NamedOnly(Arc<dyn ObjectStore>);

impl NamedOnly {
    pub(crate) fn wrap(inner: Arc<dyn ObjectStore>) -> Arc<dyn ObjectStore> {
        Arc::new(Self(inner))
    }
}

impl fmt::Display for NamedOnly {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NamedOnly({})", self.0)
    }
}

fn refused(prefix: Option<&Path>) -> object_store::Error {
    let what = prefix.map_or_else(String::new, |p| format!(" {p}"));
    object_store::Error::NotSupported {
        source: format!(
            "listing{what}: the cluster reads only the files the querying process names (is a verified file missing?)"
        )
        .into(),
    }
}

#[async_trait::async_trait]
impl ObjectStore for NamedOnly {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        self.0.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.0.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.0.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[Range<u64>],
    ) -> Result<Vec<bytes::Bytes>> {
        self.0.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        self.0.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        let e = refused(prefix);
        futures::stream::once(async move { Err(e) }).boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        Err(refused(prefix))
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.0.copy_opts(from, to, options).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::ObjectStoreExt;

    #[tokio::test]
    async fn objects_by_name_and_no_listing() {
        let inner: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let s = NamedOnly::wrap(inner);
        let p = Path::from("audit/page_reads/node=1/a.parquet");
        s.put(&p, PutPayload::from_static(b"x")).await.expect("put");
        assert_eq!(s.head(&p).await.expect("head").size, 1);
        let listed: Vec<_> = s.list(Some(&Path::from("audit"))).collect().await;
        assert!(matches!(
            listed.as_slice(),
            [Err(object_store::Error::NotSupported { .. })]
        ));
        assert!(s.list_with_delimiter(None).await.is_err());
        assert!(
            s.head(&Path::from("audit/missing.parquet"))
                .await
                .is_err_and(|e| matches!(e, object_store::Error::NotFound { .. }))
        );
    }
}
